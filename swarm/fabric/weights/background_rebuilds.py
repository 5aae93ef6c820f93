"""Rebuilds of old held versions off the thread that asks (VersionStore.state_now).

A learner holds max_staleness + 1 versions, all but the newest as undo deltas (undo.py); the
oldest of 65 at Qwen3-0.6B shape takes 64 of them, 83 s on a busy 2-core machine. Rebuilt in the
thread that asks, that stalled a training step verifying a group sampled 64 versions ago, and a
weight server's request thread (and upload slot) serving a snapshot of it. Here one thread does
such rebuilds: the reader is answered None at once (a verification is deferred, a request
answered busy) and finds the version here when it asks again.

Requests are served newest first, and the version built last is kept as the base of the next
older one (the rebuild path): the versions a batch of deferred groups asks for cost one pass down
the chain between them, not one chain each from the newest. What is built is kept until a reader
has taken it, or for HOLD_S when none comes back, so that a reader is never left asking for a
version rebuilt and dropped again; `keep` of them at most, each a whole state. A version whose
readers gave up (the groups deferred for it dropped as too stale) is forgotten at once
(VersionStore.release), its room going to the versions still waited for.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

HOLD_S = 120.0  # the longest a version rebuilt here waits for its reader while other rebuilds wait behind it


@dataclass
class Built:
    state: dict[str, torch.Tensor]
    at: float  # time.monotonic() when built
    read: bool = False


class BackgroundRebuilds:
    """One background thread rebuilding `store`'s held versions on request (a VersionStore: its
    `_rebuild` and `hashes`; not imported here, which versions.py imports); started when asked,
    gone once nothing is asked (no thread to close). keep: how many rebuilt versions are held
    for their readers at most."""

    def __init__(self, store, *, keep: int = 1) -> None:
        self.store, self.keep = store, keep
        self._cond = threading.Condition()
        self._pending: set[int] = set()
        self._built: dict[int, Built] = {}
        self._failed: dict[int, Exception] = {}  # version -> why its rebuild failed (raised to the next reader)
        self._thread: threading.Thread | None = None
        self.rebuilt = 0  # versions rebuilt here

    def request(self, version: int) -> None:
        """Rebuild held `version` in the background (once, however often asked). Raises what its
        last rebuild here failed with, once: a corrupted undo delta is said so, not retried for ever."""
        with self._cond:
            failed = self._failed.pop(version, None)
            if failed is not None:
                raise failed
            if version in self._built:
                return
            self._pending.add(version)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="version-rebuilds", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def peek(self, version: int) -> dict[str, torch.Tensor] | None:
        with self._cond:
            built = self._built.get(version)
            return built.state if built is not None else None

    def take(self, version: int) -> dict[str, torch.Tensor] | None:
        """`version` as rebuilt here, marked read (another rebuild may then take its place), or None."""
        with self._cond:
            built = self._built.get(version)
            if built is None:
                return None
            built.read = True
            self._cond.notify_all()
            return built.state

    def held(self) -> int:
        """Whole states held here (rebuilt versions waiting for, or read by, their readers)."""
        with self._cond:
            return len(self._built)

    def busy(self) -> bool:
        """Whether a rebuild is asked for or under way."""
        with self._cond:
            return bool(self._pending)

    def forget(self, version: int) -> None:
        """`version` is no longer held: drop its request and what was built of it."""
        with self._cond:
            self._pending.discard(version)
            self._built.pop(version, None)
            self._failed.pop(version, None)
            self._cond.notify_all()

    def _room(self) -> bool:
        """Under the lock: whether a rebuilt version may be added (dropping read or expired ones)."""
        now = time.monotonic()
        for version in sorted(self._built, key=lambda v: self._built[v].at):
            if len(self._built) < self.keep:
                break
            built = self._built[version]
            if built.read or now - built.at >= HOLD_S:
                del self._built[version]
        return len(self._built) < self.keep

    def _run(self) -> None:
        path: tuple[int, dict] | None = None  # the version built last and its state: the base of the next older one
        while True:
            with self._cond:
                while True:
                    if not self._pending:
                        self._thread = None
                        return
                    if self._room():
                        break
                    self._cond.wait(timeout=1.0)
                version = max(self._pending)
            extra = path if path is not None and path[0] > version else None
            try:
                state = self.store._rebuild(version, extra, where="background")
            except KeyError:  # evicted meanwhile: nobody can be waiting for it
                state = None
            except Exception as exc:  # noqa: BLE001  a bug, never a peer's doing: the next reader hears of it
                logger.error("rebuilding version %d in the background failed: %s: %s", version, type(exc).__name__, exc)
                state = None
                with self._cond:
                    self._failed[version] = exc
            with self._cond:
                self._pending.discard(version)
                if state is not None and version in self.store.hashes:
                    self._built[version] = Built(state, time.monotonic())
                    self.rebuilt += 1
                path = (version, state) if state is not None and self._pending else None
                self._cond.notify_all()
