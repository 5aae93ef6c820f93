"""Rewards: a registry of plain functions, a dotted-path escape hatch, and a scorer that bounds the
time each completion may take.

A reward function is `fn(completion: str, answer: str) -> float | None`; None means "could not be
scored" (the completion is then kept out of its group's baseline, see advantages.py), never a crash.

math-verify bounds its own work with `signal.alarm`, which works only in a process's main thread.
The scorer therefore disables math-verify's timeouts and applies its own per-completion alarm when
called on the main thread, and off the main thread (a sampler's worker thread, an asyncio executor)
sends the batch to a helper process whose main thread does the same.
"""

from __future__ import annotations

import importlib
import logging
import re
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from functools import lru_cache
from typing import Callable, Sequence

logger = logging.getLogger(__name__)
# math-verify warns on every call that its own timeouts are off; ours replace them (see above).
logging.getLogger("math_verify").setLevel(logging.ERROR)

RewardFn = Callable[[str, str], "float | None"]

# Only the tail of a completion is parsed: the answer is at the end, and a bounded input keeps a
# pathological completion from costing unbounded parsing time even before the alarm fires.
MAX_PARSE_CHARS = 4000


class RewardTimeout(Exception):
    pass


@lru_cache(maxsize=65536)
def _parse_gold(answer: str):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    text = answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
    return parse(text, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=None)


def accuracy_reward(completion: str, answer: str) -> float | None:
    """1.0 if the completion's final (boxed or clearly anchored) answer equals the gold answer under
    math-verify's equivalence (fractions, decimals, LaTeX forms), else 0.0; None if the gold answer
    itself cannot be parsed."""
    from math_verify import LatexExtractionConfig, parse, verify

    gold = _parse_gold(answer)
    if not gold:
        return None
    # Only anchored answers count: a bare number somewhere in the text is not an answer.
    pred = parse(
        completion[-MAX_PARSE_CHARS:],
        extraction_config=[LatexExtractionConfig(try_extract_without_anchor=False, boxed_match_priority=0)],
        parsing_timeout=None,
    )
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


_BOXED_AT_END = re.compile(r"\\boxed\{[^{}]*(\{[^{}]*\}[^{}]*)*\}\s*$")


def format_reward(completion: str, answer: str) -> float:
    """1.0 if the completion ends with exactly one `\\boxed{...}`, else 0.0."""
    text = completion.strip()
    return 1.0 if text.count("\\boxed{") == 1 and _BOXED_AT_END.search(text) else 0.0


REWARDS: dict[str, RewardFn] = {"accuracy": accuracy_reward, "format": format_reward}


def resolve_reward(name: str) -> RewardFn:
    """A registered name, or a dotted path `package.module:function` / `package.module.function`."""
    if name in REWARDS:
        return REWARDS[name]
    if "." not in name and ":" not in name:
        raise ValueError(
            f"unknown reward {name!r}; choose one of: {', '.join(sorted(REWARDS))}, "
            "or give a dotted path like 'mypkg.rewards:my_reward'"
        )
    module_name, _, attr = name.rpartition(":") if ":" in name else name.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import reward {name!r}: {exc}") from exc
    if not callable(fn):
        raise ValueError(f"reward {name!r} is not callable")
    return fn


@contextmanager
def _alarm(seconds: float):
    """Raise RewardTimeout after `seconds` of wall time (main thread only)."""

    def on_alarm(signum, frame):
        raise RewardTimeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _score_in_main_thread(
    rewards: Sequence[tuple[str, float]], completions: Sequence[str], answers: Sequence[str], timeout_s: float
) -> list[float | None]:
    fns = [(resolve_reward(name), weight) for name, weight in rewards]
    out: list[float | None] = []
    for completion, answer in zip(completions, answers):
        total: float | None = 0.0
        try:
            with _alarm(timeout_s):
                for fn, weight in fns:
                    value = fn(completion, answer)
                    if value is None:
                        total = None
                        break
                    total += weight * float(value)
        except RewardTimeout:
            logger.warning("reward timed out after %.1f s on a completion of %d chars", timeout_s, len(completion))
            total = None
        except Exception as exc:  # noqa: BLE001  an unscorable completion must not crash a peer
            logger.warning("reward failed on a completion (%s: %s); scored as missing", type(exc).__name__, exc)
            total = None
        out.append(total)
    return out


class RewardScorer:
    """Scores completions against gold answers: sum of weight * reward over the chosen rewards.

    rewards: (name or dotted path, weight) pairs, e.g. [("accuracy", 1.0), ("format", 0.1)].
    timeout_s: wall-clock bound per completion (seconds); a completion past it scores None.
    """

    def __init__(self, rewards: Sequence[tuple[str, float]] = (("accuracy", 1.0),), *, timeout_s: float = 2.0) -> None:
        if not rewards:
            raise ValueError("at least one reward is needed, e.g. [('accuracy', 1.0)]")
        for name, _ in rewards:
            resolve_reward(name)  # fail now, with the name, not mid-run
        self.rewards = tuple((name, float(weight)) for name, weight in rewards)
        self.timeout_s = timeout_s
        self._pool: ProcessPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def score(self, completions: Sequence[str], answers: Sequence[str]) -> list[float | None]:
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        if threading.current_thread() is threading.main_thread():
            return _score_in_main_thread(self.rewards, completions, answers, self.timeout_s)
        return self._score_in_helper_process(list(completions), list(answers))

    def _score_in_helper_process(self, completions: list[str], answers: list[str]) -> list[float | None]:
        with self._pool_lock:
            if self._pool is None:
                import multiprocessing

                self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
            pool = self._pool
        future = pool.submit(_score_in_main_thread, self.rewards, completions, answers, self.timeout_s)
        # the helper applies the per-completion alarm; this outer bound only catches a dead helper
        # (+30 s: the first call also pays for starting the helper and importing math-verify)
        try:
            return future.result(timeout=self.timeout_s * len(completions) + 30)
        except (FutureTimeout, Exception) as exc:  # noqa: BLE001
            logger.warning("reward helper process failed (%s); this batch is scored as missing", exc)
            self.close()
            return [None] * len(completions)

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                # kill first: a helper stuck in a reward would otherwise outlive the scorer
                for proc in list((getattr(self._pool, "_processes", None) or {}).values()):
                    proc.kill()
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
