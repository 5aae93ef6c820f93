"""Tasks: what prompts samplers answer and what the gold answers are.

- base.py       - Problem, the Task protocol, prompt building, stop strings, deterministic sharding per sampler.
- synthetic.py  - the built-in arithmetic task (no download; gold answers checked by math-verify).
- dataset.py    - any Hugging Face dataset id, local directory or local jsonl / json / parquet / csv file,
                  with its own splits or a hash hold-out.
"""

from __future__ import annotations

from pathlib import Path

from swarm.tasks.base import SPLITS, Problem, Task, build_prompt, cut_at_stop, shard_for_sampler
from swarm.tasks.dataset import LOCAL_FORMATS, DatasetTask, looks_local
from swarm.tasks.synthetic import ArithmeticTask

BUILTIN_TASKS = ("arithmetic",)


def check_task_name(name_or_path: str) -> None:
    """Raises what loading `name_or_path` would for a name that names no task, without loading
    anything: an unknown name (ValueError), a local file or directory that does not exist
    (FileNotFoundError). `swarm eval` asks before it loads the model, seconds of imports and weights."""
    if name_or_path in BUILTIN_TASKS:
        return
    if looks_local(name_or_path):
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"dataset {'file' if path.suffix in LOCAL_FORMATS else 'directory'} {path} does not exist")
        return
    if "/" not in name_or_path:
        raise ValueError(
            f"unknown task {name_or_path!r}: use a built-in task ({', '.join(BUILTIN_TASKS)}), a local "
            f"{'/'.join(LOCAL_FORMATS)} file or a directory of them, or a dataset id like 'owner/name'"
        )


def load_task(name_or_path: str, *, tokenizer=None, difficulty: int = 2, stop_strings=(), max_prompt_length: int | None = None,
              **dataset_options) -> Task:
    """"arithmetic" (the built-in task), or a dataset id / local file or directory for `DatasetTask`."""
    check_task_name(name_or_path)
    if name_or_path == "arithmetic":
        return ArithmeticTask(difficulty=difficulty, stop_strings=tuple(stop_strings), max_prompt_length=max_prompt_length,
                              tokenizer=tokenizer)
    return DatasetTask(name_or_path, tokenizer=tokenizer, stop_strings=tuple(stop_strings),
                       max_prompt_length=max_prompt_length, **dataset_options)


def load_problems(name_or_path: str, options: dict, *, tokenizer=None, split: str = "train") -> list[Problem]:
    """The task's problems for `split` (the same ids on every peer, so a learner can check answers)."""
    problems = list(load_task(name_or_path, tokenizer=tokenizer, **options).problems(split))
    if not problems:
        raise ValueError(f"task {name_or_path!r} has no {split} problems")
    return problems


__all__ = ["BUILTIN_TASKS", "SPLITS", "Problem", "Task", "build_prompt", "check_task_name", "cut_at_stop", "load_problems", "load_task",
           "shard_for_sampler"]
