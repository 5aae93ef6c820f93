"""Tasks from any Hugging Face dataset id or local jsonl / json / parquet / csv file.

Each row gives a question and a gold answer (configurable columns); prompts are built with the
task template, inside the tokenizer's chat template when it has one. The rows come from one split
of the source ("train" unless told otherwise; a local file is one split), and a deterministic 10%
of them (by hash of the row's id) is held out as "test"; a source's own test split is not used.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from swarm.tasks.base import DEFAULT_TEMPLATE, Problem, build_prompt

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
HOLDOUT_PERCENT = 10


def looks_local(source: str) -> bool:
    return Path(source).suffix in LOCAL_FORMATS or source.startswith((".", "/", "~"))


@dataclass
class DatasetTask:
    source: str  # local file path or hub dataset id
    question_column: str = "question"
    answer_column: str = "answer"
    template: str = DEFAULT_TEMPLATE
    answer_pattern: str | None = None  # regex with one group extracting the gold answer (e.g. "#### (.+)")
    split: str = "train"  # the source's split to read (hub datasets)
    config_name: str | None = None  # hub dataset configuration
    tokenizer: object = None
    name: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self.name = Path(self.source).stem if looks_local(self.source) else self.source
        if "{question}" not in self.template:
            raise ValueError(f"prompt template must contain '{{question}}', got {self.template!r}")

    def _load_rows(self):
        import datasets

        if looks_local(self.source):
            path = Path(self.source).expanduser()
            if not path.exists():
                raise FileNotFoundError(f"dataset file {path} does not exist")
            fmt = LOCAL_FORMATS.get(path.suffix)
            if fmt is None:
                raise ValueError(
                    f"unsupported dataset file type {path.suffix!r} for {path}; use one of {', '.join(LOCAL_FORMATS)}"
                )
            try:
                return datasets.load_dataset(fmt, data_files=str(path), split="train")
            except Exception as exc:  # noqa: BLE001  datasets raises many types for a bad file
                if "no data" in str(exc):
                    raise ValueError(f"dataset {self.source!r} is empty") from exc
                raise ValueError(f"cannot read dataset file {path} as {fmt}: {exc}") from exc
        try:
            return datasets.load_dataset(self.source, self.config_name, split=self.split)
        except Exception as exc:  # noqa: BLE001
            raise ValueError(
                f"cannot load dataset {self.source!r} (split {self.split!r}): {exc}. "
                "Give a local .jsonl/.json/.parquet/.csv file, or a dataset id reachable from this machine"
            ) from exc

    @cached_property
    def _splits(self) -> dict[str, list[Problem]]:
        rows = self._load_rows()
        columns = set(rows.column_names)
        for role, column in (("question", self.question_column), ("answer", self.answer_column)):
            if column not in columns:
                raise ValueError(
                    f"dataset {self.source!r} has no {role} column {column!r}; its columns are "
                    f"{sorted(columns)} (choose with --{role}-column)"
                )
        if len(rows) == 0:
            raise ValueError(f"dataset {self.source!r} is empty")
        pattern = re.compile(self.answer_pattern) if self.answer_pattern else None
        splits: dict[str, list[Problem]] = {"train": [], "test": []}
        for i, row in enumerate(rows):
            question, answer = str(row[self.question_column]), str(row[self.answer_column]).strip()
            if pattern:
                match = pattern.search(answer)
                if not match:
                    continue  # a row without an extractable gold answer cannot be scored
                answer = match.group(1).strip()
            pid = f"{self.name}-{i}"
            bucket = int(hashlib.sha256(pid.encode()).hexdigest(), 16) % 100
            split = "test" if bucket < HOLDOUT_PERCENT else "train"
            splits[split].append(Problem(pid, question, answer, build_prompt(question, self.tokenizer, self.template)))
        if not splits["train"] and not splits["test"]:
            raise ValueError(f"no row of dataset {self.source!r} matched answer pattern {self.answer_pattern!r}")
        return splits

    def problems(self, split: str = "train") -> list[Problem]:
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}; use 'train' or 'test'")
        return self._splits[split]
