"""Sources of a chunk judged by their delivery rate: the part of a chunked fetch
(swarm.fabric.weights.chunked_fetch.ChunkedFetch, which holds the state these read) that strikes a
relay or a redirect's target far slower than the learner."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# Sources that hold a chunk (relays holding the whole payload, and the peers a whole holder
# redirects to) are judged by their delivery rate against the best whole holder's in this fetch
# (the learner's, as a rule: until it is known, the learner is asked first, with `force`). A request
# to such a source is given up after SLOW_GRACE_S plus SLOW_RATIO times the chunk's time at that
# rate, and a source that delivers below 1/SLOW_RATIO of it, or not in that time, is struck for the
# rest of the fetch (and shunned by the follower): a peer that took every chunk from the learner and
# then served them slowly held a joining sampler to 0.1 of 3.3 MB in 28 s (issue 45)
SLOW_RATIO = 4.0
# a request's round trips and a loaded peer's stall; a chunk that came in less time is no sign of a
# slow source. The cost of a slow source to a joining peer is about this (its first requests, all
# at once, are given up together): 0.5 s put a 33.6 MB snapshot at 3.1x the honest swarm's time over
# gRPC (0.31 s honest), 1.8x over hivemind (benchmarks/slow_holder.py)
SLOW_GRACE_S = 0.2
MIN_RATED_BYTES = 1 << 16  # once a source has a rate, smaller chunks do not change it


class SourceJudging:
    """Rates of the sources a fetch asked (`rates`), the reference they are judged against, and the
    strike of a slow one."""

    def _reference(self) -> float | None:
        """The best delivery rate of a whole holder not judged itself (the learner) in this fetch."""
        with self._cond:
            return self.rates.get(self.whole[-1]) if self.whole else None

    def _judge_deadline(self, size: int) -> float | None:
        """How long a judged source may take for a chunk of `size` bytes (None: no rate known yet)."""
        reference = self._reference()
        return None if not reference else SLOW_GRACE_S + SLOW_RATIO * size / reference

    def _rated(self, peer: str, size: int, seconds: float, *, judged: bool) -> None:
        """A chunk of `size` bytes from `peer` took `seconds`: its best rate so far; a judged source
        far slower than the reference is struck (its chunk is kept: it verified)."""
        if size < MIN_RATED_BYTES and peer in self.rates:
            return  # a small chunk's round trip says more of the request than of the link
        rate = size / max(seconds, 1e-6)
        with self._cond:
            self.rates[peer] = max(self.rates.get(peer, 0.0), rate)
        reference = self._reference()
        if judged and reference and seconds > SLOW_GRACE_S and rate * SLOW_RATIO < reference:
            self._slow_source(peer, f"{rate / 1e6:.2f} MB/s against the learner's {reference / 1e6:.2f} MB/s")

    def _slow_source(self, peer: str, why: str) -> None:
        logger.warning("peer %s delivers chunks of %s %d too slowly (%s): not asked again in this fetch", peer,
                       self.spec.kind, self.spec.version, why)
        with self._cond:
            self.slow.add(peer)
            self._dead.add(peer)
        if self.on_unreachable is not None and not self.finished:
            self.on_unreachable(peer, TimeoutError(f"too slow: {why}"))
