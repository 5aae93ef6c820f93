"""What the learner and the sampler share: how a peer starts, stops and tears down. A peer holds each
resource as it acquires it, and one teardown closes them all, newest first: the heartbeat before the
fabric it announces through, the dashboard before the fabric it reads, the fabric last. A start that
fails part-way closes what it had opened and leaves no half-made run directory behind.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from swarm.signals import install_stop_signals

T = TypeVar("T")


class Peer:
    """A peer with named steps: `setup` (join, open what it needs), `main_loop` (until done or
    stopped), `stop` (one teardown) and `result` (what `run` returns). Subclasses fill them in.

    echo: hears what the peer says to its user (one line per call); stop: set to end the run
    (SIGINT and SIGTERM set it too, from the main thread)."""

    def __init__(self, *, echo: Callable[[str], None], stop: threading.Event | None) -> None:
        self.echo = echo
        self.stop_event = stop or threading.Event()
        self._held = contextlib.ExitStack()

    def run(self) -> dict:
        """Set up, loop, then tear down whatever happened; the result once everything is closed."""
        install_stop_signals(self.stop_event)
        try:
            self.setup()
            self.main_loop()
        finally:
            self.stop()
        return self.result()

    def setup(self) -> None:
        raise NotImplementedError

    def main_loop(self) -> None:
        raise NotImplementedError

    def result(self) -> dict:
        raise NotImplementedError

    def hold(self, resource: T, close: str = "close") -> T:
        """Has `stop` call `resource.<close>()` (before anything held earlier); None holds nothing."""
        if resource is not None:
            self._held.callback(getattr(resource, close))
        return resource

    def at_stop(self, callback: Callable[[], object]) -> None:
        """Has `stop` call `callback` at this point of the teardown (before anything held earlier)."""
        self._held.callback(callback)

    def stop(self) -> None:
        """Closes everything held, newest first. Safe to call again: a second call closes nothing."""
        self._held.close()

    @property
    def stopping(self) -> bool:
        return self.stop_event.is_set()

    @contextlib.contextmanager
    def first_start_in(self, run_dir: Path) -> Iterator[None]:
        """A start that fails in this block (no swarm, a port taken) closes what it opened, then
        removes `run_dir` if this start is what made it: a failed first start leaves nothing behind,
        and the next one is not refused for a run directory that holds a run."""
        made = not run_dir.exists()
        try:
            yield
        except BaseException:
            self.stop()  # its DHT and averager processes would outlive this one
            if made:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
