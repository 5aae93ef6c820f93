"""Tasks from a Hugging Face dataset id, a local directory of data files, or one local jsonl /
json / parquet / csv file.

Each row gives a question and a gold answer (configurable columns; `answer_pattern` extracts the
gold answer from a longer answer text, as GSM8K's "... #### 42"); prompts are the template filled
in, after an optional system prompt, inside the tokenizer's chat template unless told otherwise.

Splits. A hub dataset, or a local directory whose files are named by split (train.jsonl,
test.jsonl, as on the hub), has splits of its own; a single local file is one split, "train".
`problems(split)` reads (`plan_split`):
- "train": the source's train split; when the source has no test split, less a deterministic 10%
  of its rows (by hash of the row's id) held out as "test";
- "test": the source's own test split, or else that 10% hold-out;
- "all": every row of every split (what `swarm eval` reads when the source has no test split).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Sequence

from swarm.config import TaskSettings, default_of
from swarm.hub import hub_offline, hub_unreachable
from swarm.tasks.base import DEFAULT_TEMPLATE, SPLITS, Problem, build_prompt, check_template

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
HOLDOUT_PERCENT = 10
HOLDOUT = "test"  # the part of a train split held out when the source has no test split


def quiet_datasets():
    """The `datasets` module with its progress bars and info logging off: a peer's or `swarm eval`'s
    output is its own lines, not "Generating train split: 0 examples" on stderr."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def root_cause(exc: BaseException | None) -> str:
    """The innermost message of an exception chain: datasets wraps a file's parse error in "An error
    occurred while generating the dataset", which names neither the file's problem nor its place."""
    messages = []
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if str(exc).strip():
            messages.append(str(exc).strip())
        exc = exc.__cause__ or exc.__context__
    return messages[-1] if messages else "no reason given"


JSONL_ROW = '{"question": "...", "answer": "..."}'


def check_jsonl(path: Path) -> None:
    """A .jsonl file must hold rows, one JSON object per line: say which line is not."""
    import json

    rows = 0
    with open(path, encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"dataset file {path}, line {number}: not valid JSON ({exc}); each line of a .jsonl "
                                 f"file must be one JSON object, like {JSONL_ROW}") from None
            if not isinstance(row, dict):
                raise ValueError(f"dataset file {path}, line {number}: a JSON {type(row).__name__}, not an object; each "
                                 f"line of a .jsonl file must be one JSON object, like {JSONL_ROW}")
            rows += 1
    if rows == 0:
        raise ValueError(f"dataset file {path} is empty: it holds no rows; write one JSON object per line, like {JSONL_ROW}")


def looks_local(source: str) -> bool:
    return Path(source).suffix in LOCAL_FORMATS or source.startswith((".", "/", "~")) or Path(source).expanduser().exists()


def compile_answer_pattern(pattern: str | None) -> re.Pattern | None:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"answer pattern {pattern!r} is not a regular expression: {exc}") from None


def extract_answer(text: object, pattern: re.Pattern | None) -> str | None:
    """The gold answer in an answer cell: its first group's match (or the whole match, for a
    pattern without groups), or the whole cell without a pattern; None when there is none."""
    if text is None:
        return None
    text = str(text).strip()
    if pattern is None:
        return text or None
    match = pattern.search(text)
    if match is None:
        return None
    found = match.group(1) if pattern.groups else match.group(0)
    return (found or "").strip() or None  # an optional group that matched nothing gives None


def plan_split(wanted: str, available: Sequence[str], source: str = "dataset") -> list[tuple[str, str | None]]:
    """The source splits to read for `wanted`, each with the part of its rows to keep: None (every
    row), "train" (the rows not held out) or "test" (the hold-out)."""
    if wanted not in SPLITS:
        raise ValueError(f"unknown split {wanted!r}; use one of: {', '.join(SPLITS)}")
    if wanted == "all":
        return [(split, None) for split in available]
    if HOLDOUT in available:  # the source's own test split: nothing held out of its train split
        if wanted not in available:
            raise ValueError(f"{source} has no {wanted} split; its splits are {', '.join(available)}")
        return [(wanted, None)]
    if "train" not in available:
        raise ValueError(f"{source} has neither a train nor a test split; its splits are {', '.join(available)}")
    return [("train", wanted)]


@dataclass
class DatasetTask:
    source: str  # local file or directory, or hub dataset id
    question_column: str = default_of(TaskSettings, "question_column")
    answer_column: str = default_of(TaskSettings, "answer_column")
    prompt_template: str = DEFAULT_TEMPLATE
    system_prompt: str | None = None
    apply_chat_template: bool = default_of(TaskSettings, "apply_chat_template")  # False: plain text even with a chat template
    answer_pattern: str | None = None  # regex extracting the gold answer (e.g. "####\s*(.+)" for GSM8K)
    dataset_config: str | None = None  # hub dataset configuration (GSM8K: "main")
    stop_strings: tuple[str, ...] = ()  # completions are cut at the first of these before scoring
    max_prompt_length: int | None = None  # prompts cut to their last this many tokens (truncate_prompt)
    tokenizer: object = None
    name: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self.name = Path(self.source).stem if looks_local(self.source) else self.source
        check_template(self.prompt_template)
        self._pattern = compile_answer_pattern(self.answer_pattern)
        self.stop_strings = tuple(self.stop_strings)
        self._rows_of: dict[str, list[tuple[str, Problem | None]]] = {}

    # -- the source and its splits

    @property
    def _single_file(self) -> bool:
        return looks_local(self.source) and not Path(self.source).expanduser().is_dir()

    @cached_property
    def source_splits(self) -> list[str]:
        """The splits the source has ("train" for a single file)."""
        if self._single_file:
            return ["train"]
        datasets = quiet_datasets()

        self._check_reachable()
        try:
            return list(datasets.get_dataset_split_names(self._location, self.dataset_config))
        except Exception as exc:  # noqa: BLE001  datasets raises many types for a bad id or config
            raise ValueError(self._cannot_load(exc)) from exc

    @property
    def eval_split(self) -> str:
        """`swarm eval` reads the source's own test split, or every row when it has none."""
        return HOLDOUT if HOLDOUT in self.source_splits else "all"

    @property
    def _location(self) -> str:
        return str(Path(self.source).expanduser()) if looks_local(self.source) else self.source

    def _check_reachable(self) -> None:
        """A hub id fails at once when the hub cannot be reached (datasets would retry for ~25 s)."""
        if looks_local(self.source):
            if not Path(self._location).exists():
                raise FileNotFoundError(f"dataset directory {self._location} does not exist")
            return
        reason = None if hub_offline() else hub_unreachable()
        if reason:
            raise ConnectionError(
                f"dataset {self.source!r} is not a local file or directory and the Hugging Face hub cannot be reached: "
                f"{reason}. Give a local {'/'.join(LOCAL_FORMATS)} file or a directory of them, or set "
                "HF_HUB_OFFLINE=1 to use a copy in the Hugging Face cache")

    def _cannot_load(self, exc: Exception, split: str | None = None) -> str:
        what = ", ".join(f"{k} {v!r}" for k, v in (("config", self.dataset_config), ("split", split)) if v)
        return (f"cannot load dataset {self.source!r}{f' ({what})' if what else ''}: {root_cause(exc)}. Give a local "
                f"{'/'.join(LOCAL_FORMATS)} file or directory, or a dataset id reachable from this machine "
                "(with --dataset-config where it has several)")

    def _read_split(self, split: str):
        datasets = quiet_datasets()

        if not self._single_file:
            try:
                return datasets.load_dataset(self._location, self.dataset_config, split=split)
            except Exception as exc:  # noqa: BLE001
                raise ValueError(self._cannot_load(exc, split)) from exc
        path = Path(self._location)
        if not path.exists():
            raise FileNotFoundError(f"dataset file {path} does not exist")
        fmt = LOCAL_FORMATS.get(path.suffix)
        if fmt is None:
            raise ValueError(f"unsupported dataset file type {path.suffix!r} for {path}; use one of {', '.join(LOCAL_FORMATS)}")
        if path.stat().st_size < 4096 and not path.read_bytes().strip():  # blank: nothing for datasets to name
            raise ValueError(f"dataset file {path} is empty: it holds no rows")
        if path.suffix == ".jsonl":
            check_jsonl(path)
        try:
            return datasets.load_dataset(fmt, data_files=str(path), split="train")
        except Exception as exc:  # noqa: BLE001  datasets raises many types for a bad file
            if "no data" in str(exc):
                raise ValueError(f"dataset {self.source!r} is empty") from exc
            raise ValueError(f"cannot read dataset file {path} as {fmt}: {root_cause(exc)}") from exc

    # -- rows to problems

    def _rows(self, split: str) -> list[tuple[str, Problem | None]]:
        """(hold-out part, problem) per row of a source split; the problem is None for a row
        without a question or a gold answer (it cannot be scored)."""
        if split in self._rows_of:
            return self._rows_of[split]
        rows = self._read_split(split)
        columns = set(rows.column_names)
        for role, column in (("question", self.question_column), ("answer", self.answer_column)):
            if column not in columns:
                raise ValueError(f"dataset {self.source!r} has no {role} column {column!r}; its columns are "
                                 f"{sorted(columns)} (choose with --{role}-column)")
        if len(rows) == 0:
            raise ValueError(f"dataset {self.source!r} is empty" + ("" if self._single_file else f" (split {split!r})"))
        out = []
        for i, row in enumerate(rows):
            # train rows keep the ids they had before sources had splits (the hold-out depends on them)
            pid = f"{self.name}-{i}" if split == "train" else f"{self.name}-{split}-{i}"
            bucket = int(hashlib.sha256(pid.encode()).hexdigest(), 16) % 100
            question, answer = row[self.question_column], extract_answer(row[self.answer_column], self._pattern)
            problem = None
            if question is not None and str(question).strip() and answer is not None:
                problem = Problem(pid, str(question), answer, self._prompt(str(question)))
            out.append((HOLDOUT if bucket < HOLDOUT_PERCENT else "train", problem))
        if all(problem is None for _, problem in out):
            raise ValueError(f"no row of dataset {self.source!r} has a gold answer"
                             + (f" matching answer pattern {self.answer_pattern!r}" if self.answer_pattern else ""))
        self._rows_of[split] = out
        return out

    def _prompt(self, question: str) -> str:
        return build_prompt(question, self.tokenizer, self.prompt_template, system_prompt=self.system_prompt,
                            apply_chat_template=self.apply_chat_template, max_prompt_length=self.max_prompt_length)

    def _select(self, split: str) -> tuple[list[Problem], int]:
        """The problems of `split` and how many of its rows had no gold answer."""
        kept: list[Problem] = []
        skipped = 0
        for source_split, part in plan_split(split, self.source_splits, f"dataset {self.source!r}"):
            for row_part, problem in self._rows(source_split):
                if part is None or row_part == part:
                    kept += [problem] if problem is not None else []
                    skipped += problem is None
        return kept, skipped

    def problems(self, split: str = "train") -> list[Problem]:
        return self._select(split)[0]

    def skipped_rows(self, split: str) -> int:
        """Rows of `split` left out for want of a question or a gold answer (`answer_pattern` not matching)."""
        return self._select(split)[1]

    def describe_split(self, split: str) -> str:
        if split == "all":
            if self._single_file:
                return f"every row of {self.name}"
            return f"every split of {self.name} ({', '.join(self.source_splits)})"
        if HOLDOUT in self.source_splits:
            return f"the {split} split of {self.name}"
        if split == HOLDOUT:
            return f"the {HOLDOUT_PERCENT}% hold-out of {self.name}'s rows"
        return f"{self.name}'s rows less their {HOLDOUT_PERCENT}% hold-out"
