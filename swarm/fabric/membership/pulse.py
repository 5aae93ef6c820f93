"""A peer's heartbeat on its own schedule.

Membership records expire a few heartbeats after the last one, so a peer that heartbeats only
between units of work (a sampler after a send, a learner between steps) vanishes from the swarm's
listing whenever one unit takes longer than that: every round of a real LLM, every wait for a
first version or for a restarting learner. `Pulse` beats from a thread of its own, every
`interval_s` and at once when poked (a new version published or fetched, so relaying peers learn
of it without waiting a whole interval). Closed, it beats once more with `farewell` (the record
that says the peer is leaving) after the last regular beat, which could otherwise overwrite it.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

logger = logging.getLogger(__name__)


class Pulse:
    """Calls `beat()` every `interval_s` seconds, and at once on `poke()`, until closed. A failed beat
    (the swarm unreachable for a moment) is logged and the next one is tried on schedule."""

    def __init__(self, beat: Callable[[], object], interval_s: float, *, name: str = "heartbeat",
                 farewell: Callable[[], object] | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"a heartbeat interval must be > 0 seconds, got {interval_s}")
        self.beat, self.interval_s, self.farewell = beat, interval_s, farewell
        self.beats = self.failures = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def poke(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before the beat: a poke during it brings the next one at once
            try:
                self.beat()
                self.beats += 1
            except Exception as exc:  # noqa: BLE001  fault-tolerance boundary: the next beat may get through
                self.failures += 1
                log = logger.warning if self.failures in (1, 10) or self.failures % 100 == 0 else logger.debug
                log("heartbeat failed (%d in all): %s: %s", self.failures, type(exc).__name__, exc)
            self._wake.wait(self.interval_s)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        if self.farewell is not None and not self._thread.is_alive():
            try:
                self.farewell()
            except Exception as exc:  # noqa: BLE001  a peer leaving unheard is dropped when its record expires
                logger.warning("the leaving record could not be written: %s: %s", type(exc).__name__, exc)
