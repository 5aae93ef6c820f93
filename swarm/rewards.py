"""Rewards: a registry of plain functions, a dotted-path escape hatch, and a scorer that bounds the
time each completion may take.

A reward function is `fn(completion: str, answer: str) -> float | None`; None means "could not be
scored" (the completion is then kept out of its group's baseline, see advantages.py), never a crash.

Scoring runs in a worker process of the scorer's own, never in the caller's: a completion can
send math-verify into one C-level operation no alarm interrupts (`\\boxed{9^{9^{9}}}` is 17
characters), and a learner scores what samplers send. Inside the worker each completion gets an
alarm of `timeout_s` (math-verify's own timeouts are off: they use the same signal); when the
worker has not answered `timeout_s` + `KILL_GRACE_S` after it started a completion, it is killed,
that completion scores None, and a fresh worker scores the rest. The caller never waits longer
than that per completion, from any thread.
"""

from __future__ import annotations

import importlib
import logging
import re
import signal
import threading
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
# Beyond a completion's own alarm, how long the worker may take before it is killed (seconds): the
# alarm itself, the pipe, a loaded machine.
KILL_GRACE_S = 1.0
# A new worker's start (a fresh interpreter importing math-verify) is bounded separately.
WORKER_START_S = 60.0


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


def score_one(fns, completion: str, answer: str, timeout_s: float) -> float | None:
    total: float | None = 0.0
    try:
        with _alarm(timeout_s):
            for fn, weight in fns:
                value = fn(completion, answer)
                if value is None:
                    return None
                total += weight * float(value)
    except RewardTimeout:
        logger.warning("reward timed out after %.1f s on a completion of %d chars", timeout_s, len(completion))
        return None
    except Exception as exc:  # noqa: BLE001  an unscorable completion must not crash a peer
        logger.warning("reward failed on a completion (%s: %s); scored as missing", type(exc).__name__, exc)
        return None
    return total


def _worker_main(read_fd: int, write_fd: int) -> None:
    """The worker process (`python -m swarm.rewards READ_FD WRITE_FD`): gets its rewards and
    timeout, says "ready" once they are imported, then scores each batch it receives, one answer
    per completion, as it goes. Only its parent talks to it, over inherited pipes."""
    from multiprocessing.connection import Connection

    # Ctrl-C in a terminal signals the whole process group, this worker too: its parent decides when
    # it ends (it closes the pipe, or kills it), and a KeyboardInterrupt here only printed a traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    rewards, timeout_s = inbox.recv()
    fns = [(resolve_reward(name), weight) for name, weight in rewards]
    # One completion before "ready", with no alarm: math-verify imports sympy on its first call, and an
    # alarm fired inside that import (a loaded machine takes seconds) leaves it half-imported, so that
    # every later completion fails and scores None for the rest of the run
    for fn, _ in fns:
        if fn not in REWARDS.values():  # the built-in ones only: a user's reward may be slow by design
            continue
        try:
            fn("\\boxed{1}", "1")
        except Exception:  # noqa: BLE001 - a reward that fails here fails per completion later, as before
            pass
    try:
        outbox.send("ready")
        while True:
            batch = inbox.recv()
            for completion, answer in batch:
                outbox.send(score_one(fns, completion, answer, timeout_s))
    except (EOFError, BrokenPipeError):  # the parent closed the pipes or died (a Ctrl-C): nothing left to score for
        return


class _Worker:
    """A scoring process started with `python -m swarm.rewards`: a fresh interpreter, so nothing of
    the caller (its threads, its __main__) is forked or re-run."""

    def __init__(self, rewards: Sequence[tuple[str, float]], timeout_s: float) -> None:
        import os
        import subprocess
        import sys
        from multiprocessing.connection import Connection

        child_read, parent_write = os.pipe()
        parent_read, child_write = os.pipe()
        # the child imports what the parent can (a reward given as a dotted path in the caller's code)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen([sys.executable, "-m", "swarm.rewards", str(child_read), str(child_write)],
                                        pass_fds=(child_read, child_write), env=env, stdin=subprocess.DEVNULL)
        os.close(child_read)
        os.close(child_write)
        self.conn = Connection(parent_read, writable=False)
        self._send = Connection(parent_write, readable=False)
        try:
            self._send.send((tuple(rewards), timeout_s))
            ready = self.conn.poll(WORKER_START_S) and self.conn.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.kill()
            raise RuntimeError(f"the reward worker did not start within {WORKER_START_S:.0f} s (exit status {self.process.poll()})")

    def send(self, batch: list[tuple[str, str]]) -> None:
        self._send.send(batch)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(5)
        self.conn.close()
        self._send.close()


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
        self.killed = 0  # workers killed for running past a completion's deadline
        self._worker: _Worker | None = None
        self._lock = threading.Lock()  # one batch at a time through the worker

    def score(self, completions: Sequence[str], answers: Sequence[str]) -> list[float | None]:
        """One score per completion (None: could not be scored in time, or at all)."""
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        items = list(zip(map(str, completions), map(str, answers)))
        out: list[float | None] = []
        with self._lock:
            while len(out) < len(items):
                pending = items[len(out):]
                if self._worker is None:
                    self._worker = _Worker(self.rewards, self.timeout_s)
                worker = self._worker
                worker.send(pending)
                for completion, _ in pending:
                    if worker.conn.poll(self.timeout_s + KILL_GRACE_S):
                        out.append(worker.conn.recv())
                        continue
                    logger.warning("reward worker stuck on a completion of %d chars for %.1f s; killed, scored as missing",
                                   len(completion), self.timeout_s + KILL_GRACE_S)
                    worker.kill()
                    self._worker = None
                    self.killed += 1
                    out.append(None)
                    break
        return out

    def close(self) -> None:
        with self._lock:
            if self._worker is not None:
                self._worker.kill()
                self._worker = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


if __name__ == "__main__":  # the worker process of a RewardScorer
    import sys

    _worker_main(int(sys.argv[1]), int(sys.argv[2]))
