"""Stopping a long-running peer cleanly: SIGINT and SIGTERM set an event the peer's loop watches,
so it finishes its round, checkpoints and leaves the swarm instead of dying mid-write."""

from __future__ import annotations

import signal
import threading


def install_stop_signals(stop: threading.Event) -> None:
    """SIGINT/SIGTERM set `stop` (only from the main thread; elsewhere, e.g. a test's worker thread,
    the caller's own `stop` event is the way to stop)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: set_outside_the_handler(stop))


def set_outside_the_handler(event: threading.Event) -> None:
    """Set `event` from a thread of its own. A Python signal handler runs in the main thread between
    two of its bytecodes, possibly while that thread is inside `event.wait()` holding the event's
    non-reentrant lock; `event.set()` right there would wait for that lock forever."""
    threading.Thread(target=event.set, name="stop-signal", daemon=True).start()
