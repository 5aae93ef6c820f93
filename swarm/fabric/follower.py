"""How a sampler keeps up with the learner's versions: a background thread polls the announcements
signed by the learner keys it was given and fetches each new version into a `VersionStore`, so
generation pauses only for the weight swap itself.

Where a version is fetched from is `holders_for`'s decision; today it is always the peer that
announced it (the learner), so no sampler fetches from another and the learner's upload grows with
the samplers. `fetch_from_holders` already tries several holders in order and skips one that is
unreachable or sends a version that does not verify; fetching from other holders needs a
`holders_for` that knows who holds what (not built).

For experiments on one machine, the pickup of a version can be delayed by a random number of
seconds (`pickup_delay`, the paper's log-normal latency model) and generation can lag a fixed
number of versions behind (`lag_steps`): see `usable_version`.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Callable, Iterable, Sequence

from swarm.fabric.versions import Announced, FetchResult, VersionStore
from swarm.fabric.weight_delta import CorruptVersion

logger = logging.getLogger(__name__)


def holders_for(announcement: Announced) -> list[str]:
    """The peers to fetch an announced version from, in the order to try them."""
    return [announcement.peer_id]


def fetch_from_holders(client, holders: Sequence[str], want: int, want_hash: str, store: VersionStore,
                       unreachable: tuple[type[BaseException], ...]) -> FetchResult:
    """Version `want` from the first holder that serves it whole and verified. Raises the last
    holder's error when none does (nothing is added to `store` then)."""
    if not holders:
        raise ValueError("no holder to fetch from")
    failure: BaseException | None = None
    for holder in holders:
        try:
            return client.fetch(holder, want, want_hash, store)
        except (*unreachable, CorruptVersion, KeyError) as exc:  # fault-tolerance boundary: try the next
            logger.info("holder %s could not serve version %d: %s: %s", holder, want, type(exc).__name__, exc)
            failure = exc
    raise failure


def usable_version(held: Iterable[int], ready_at: dict[int, float], newest: int | None, lag_steps: int, now: float,
                   *, have_one: bool) -> int | None:
    """The newest held version whose pickup time has come and that is at least `lag_steps` behind
    the newest announced one. When none qualifies: None if the sampler already has a version (it
    keeps it), else the oldest held one (a sampler must start with something, and while the
    learner is younger than the lag nothing older exists)."""
    held = list(held)
    if not held:
        return None
    limit = (newest if newest is not None else max(held)) - lag_steps
    ok = [v for v in held if ready_at.get(v, float("inf")) <= now and v <= limit]
    if ok:
        return max(ok)
    return None if have_one else min(held)


class VersionFollower:
    """Background thread: polls the learners' announcements and fetches each new version into
    `store` (deltas when it can), stamping each with the time it may be used. `on_fetch` gets each
    FetchResult (from the follower's thread); a failed fetch, whatever the holder did, is reported
    (the 1st, 10th and every 100th time in a row) and retried at the next poll."""

    def __init__(self, fabric, store: VersionStore, learner_keys: list[bytes], delay, rng: random.Random, *,
                 echo: Callable[[str], None], on_fetch: Callable[[FetchResult], None] | None = None,
                 poll_s: float = 1.0, max_payload_bytes: int | None = None) -> None:
        self.fabric, self.store, self.keys, self.delay, self.rng, self.echo = fabric, store, learner_keys, delay, rng, echo
        self.on_fetch, self.poll_s = on_fetch, poll_s
        self.client = fabric.weight_client(**({"max_payload_bytes": max_payload_bytes} if max_payload_bytes else {}))
        self.ready_at: dict[int, float] = {}
        self.newest: int | None = None  # newest version announced
        self.learner_peer: str | None = None  # the peer that announced it
        self.sampling = None  # the run's sampling settings (RunSampling), as last announced
        self.stop = threading.Event()
        self._failures = 0
        self._thread = threading.Thread(target=self._run, name="version-follower", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        unreachable = self.fabric.unreachable_errors()
        while not self.stop.is_set():
            try:
                ann = self.fabric.latest_announced(self.keys)
            except Exception as exc:  # noqa: BLE001  a lookup hiccup: try again next poll
                logger.debug("announcement lookup failed: %s", exc)
                ann = None
            if ann is not None:
                self.newest, self.learner_peer, self.sampling = ann.version, ann.peer_id, ann.sampling
                if self.store.latest is None or ann.version > self.store.latest:
                    try:
                        fetched = fetch_from_holders(self.client, holders_for(ann), ann.version, ann.hash, self.store, unreachable)
                    except Exception as exc:  # noqa: BLE001  fault-tolerance boundary: whatever a holder did, retry
                        self._failures += 1
                        if self._failures in (1, 10) or self._failures % 100 == 0:
                            self.echo(f"could not fetch version {ann.version} ({type(exc).__name__}: {exc}); retrying")
                    else:
                        self._failures = 0
                        ready = time.time() + self.delay.draw(self.rng)
                        with self.store.lock:
                            for v in self.store.states:
                                self.ready_at.setdefault(v, ready)
                        if self.on_fetch:
                            try:
                                self.on_fetch(fetched)
                            except Exception as exc:  # noqa: BLE001  reporting must never stop the following
                                logger.warning("reporting version %d failed: %s", fetched.version, exc)
                        continue  # look again at once: the learner may be further ahead already
            self.stop.wait(self.poll_s)

    def usable(self, lag_steps: int, *, have_one: bool) -> int | None:
        with self.store.lock:
            return usable_version(list(self.store.states), self.ready_at, self.newest, lag_steps, time.time(), have_one=have_one)

    def close(self) -> None:
        self.stop.set()
        self._thread.join(timeout=30)
        self.client.close()
