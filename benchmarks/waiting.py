"""Polling until something holds, for tests and benchmarks that drive real peers: one helper, with
one message when time runs out."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float, what: str = "the condition", *, every: float = 0.1,
               logs: Callable[[], str] | None = None) -> T:
    """Call `condition` every `every` seconds until it returns something truthy, and return that.
    After `timeout` seconds an AssertionError names `what` and adds `logs()` (the peers' output)."""
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found:
            return found
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}" + (f"\n{logs()}" if logs else ""))
        time.sleep(every)
