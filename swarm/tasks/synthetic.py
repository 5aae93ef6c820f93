"""The built-in synthetic math task: integer arithmetic of adjustable difficulty.

Gold answers are integers that math-verify checks against a `\\boxed{}` expression, so the task
exercises exactly the reward path real math datasets use, with no download.

Difficulty d in 1..4:
  1: a + b            with a, b < 10
  2: a + b, a - b     with a, b < 100 (the embedded default)
  3: a + b, a - b     with a, b < 1000, and a * b with a, b < 13
  4: a op b op c      with two operations from {+, -, *}, operands < 100
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import cached_property

from swarm.tasks.base import SPLITS, Problem, truncate_prompt

SPLIT_SEEDS = {"train": 0, "test": 1}
# distinct expressions each difficulty can produce (d >= 3: effectively unbounded)
CAPACITY = {1: 100, 2: 20_000, 3: 10**6, 4: 10**7}


def arithmetic_prompt(expression: str) -> str:
    return f"Compute {expression}. Answer in \\boxed{{}}.\n"


def _draw(rng: random.Random, difficulty: int) -> str:
    if difficulty == 1:
        return f"{rng.randrange(10)}+{rng.randrange(10)}"
    if difficulty == 2:
        return f"{rng.randrange(100)}{rng.choice('+-')}{rng.randrange(100)}"
    if difficulty == 3:
        if rng.random() < 0.25:
            return f"{rng.randrange(13)}*{rng.randrange(13)}"
        return f"{rng.randrange(1000)}{rng.choice('+-')}{rng.randrange(1000)}"
    if difficulty == 4:
        return f"{rng.randrange(100)}{rng.choice('+-*')}{rng.randrange(100)}{rng.choice('+-*')}{rng.randrange(100)}"
    raise ValueError(f"arithmetic difficulty must be 1..4, got {difficulty}")


@dataclass
class ArithmeticTask:
    """Up to `size` distinct train problems and a quarter as many test problems, disjoint
    (difficulty 1 has only 100 expressions: 20 go to test, 80 to train)."""

    difficulty: int = 2
    size: int = 2000
    stop_strings: tuple[str, ...] = ()  # completions are cut at the first of these before scoring
    max_prompt_length: int | None = None  # prompts cut to their last this many tokens (truncate_prompt)
    tokenizer: object = None  # needed only with max_prompt_length
    name: str = field(init=False, default="arithmetic")
    eval_split: str = field(init=False, default="test")  # held out by construction

    def __post_init__(self) -> None:
        if not 1 <= self.difficulty <= 4:
            raise ValueError(f"arithmetic difficulty must be 1..4, got {self.difficulty}")
        if self.size < 1:
            raise ValueError(f"task size must be >= 1, got {self.size}")
        self.stop_strings = tuple(self.stop_strings)

    @cached_property
    def _splits(self) -> dict[str, list[Problem]]:
        seen: set[str] = set()
        splits: dict[str, list[Problem]] = {}
        # test first, so that the test set never depends on the train size
        wanted = {"test": min(max(1, self.size // 4), CAPACITY[self.difficulty] // 5), "train": self.size}
        for split in ("test", "train"):
            rng = random.Random(SPLIT_SEEDS[split] * 1_000_003 + self.difficulty)
            out: list[Problem] = []
            attempts = 0
            while len(out) < wanted[split] and attempts < wanted[split] * 200:
                attempts += 1
                expr = _draw(rng, self.difficulty)
                if expr in seen:
                    continue
                seen.add(expr)
                answer = str(eval(expr, {"__builtins__": {}}))  # our own digits and + - * only
                out.append(Problem(f"arith-d{self.difficulty}-{expr}", expr, answer,
                                   truncate_prompt(arithmetic_prompt(expr), self.tokenizer, self.max_prompt_length)))
            splits[split] = out
        return splits

    def problems(self, split: str = "train") -> list[Problem]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r} for the arithmetic task; use one of: {', '.join(SPLITS)}")
        if split == "all":
            return self._splits["train"] + self._splits["test"]
        return self._splits[split]

    def skipped_rows(self, split: str) -> int:
        return 0  # every generated problem has its answer

    def describe_split(self, split: str) -> str:
        return {"all": "every arithmetic problem (train and test)"}.get(split, f"the arithmetic {split} split")
