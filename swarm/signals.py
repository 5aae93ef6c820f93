"""Stopping a long-running peer cleanly: SIGINT and SIGTERM set an event the peer's loop watches,
so it finishes its round, checkpoints and leaves the swarm instead of dying mid-write. Which signal
did it is remembered (`stopped_by`): the command then says so and exits 130 after a Ctrl-C, as a
shell expects of a program that SIGINT ended."""

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
_received: list[int] = []  # the signals that came, in order (list.append is safe in a handler)


def install_stop_signals(stop: threading.Event) -> None:
    """SIGINT/SIGTERM set `stop` (only from the main thread; elsewhere, e.g. a test's worker thread,
    the caller's own `stop` event is the way to stop)."""
    global _relay
    if threading.current_thread() is not threading.main_thread():
        return
    if _relay is None:
        _relay = threading.Thread(target=_set_each, name="stop-signals", daemon=True)
        _relay.start()

    def on_signal(signum, frame) -> None:
        _received.append(signum)
        _to_set.put(stop)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


def stopped_by() -> int | None:
    """The first stop signal this process received through `install_stop_signals` (None: none)."""
    return _received[0] if _received else None


def note_signal(signum: int) -> None:
    """Remember `signum` as a stop signal received some other way (a KeyboardInterrupt caught)."""
    _received.append(signum)


def _set_each() -> None:
    while True:
        _to_set.get().set()
