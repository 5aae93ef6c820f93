"""Stopping a long-running peer cleanly: SIGINT and SIGTERM set an event the peer's loop watches,
so it finishes its round, checkpoints and leaves the swarm instead of dying mid-write."""

from __future__ import annotations

import queue
import signal
import threading

# The handler does not set the event itself. A Python signal handler runs in the main thread between
# two of its bytecodes, possibly while that thread is inside `event.wait()` holding the event's
# non-reentrant lock: `event.set()` right there would wait for that lock forever. It hands the event
# to one relay thread instead, through a queue whose put is safe in a handler (SimpleQueue's is
# reentrant); the thread is started when the handlers are installed, never inside one.
_to_set: queue.SimpleQueue = queue.SimpleQueue()
_relay: threading.Thread | None = None


def install_stop_signals(stop: threading.Event) -> None:
    """SIGINT/SIGTERM set `stop` (only from the main thread; elsewhere, e.g. a test's worker thread,
    the caller's own `stop` event is the way to stop)."""
    global _relay
    if threading.current_thread() is not threading.main_thread():
        return
    if _relay is None:
        _relay = threading.Thread(target=_set_each, name="stop-signals", daemon=True)
        _relay.start()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: _to_set.put(stop))


def _set_each() -> None:
    while True:
        _to_set.get().set()
