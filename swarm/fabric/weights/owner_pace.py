"""How fast each stripe's owner delivers, and when to take a slow owner's stripe from whole holders.

In stripes (more sharers than a chain takes: swarm.fabric.weights.chunked_fetch), every peer fetches
each owner's stripe from that owner, so one slow owner held every other peer to its pace: with one
20 Mbit/s sampler among 8 at 100 Mbit/s, the seven others took a 100 MB snapshot in 48.9 s against
12.7 s on equal links (3.85x), and a delta's payload in 10.5 s against 2.6 s (4.0x;
benchmarks/fanout_wan.py, GEPO_FANOUT_SLOW_MBIT=20, stripes). A chain's pass-over
(swarm.fabric.weights.upstream_pace) does not apply: a stripe has no peer before its owner to ask.

Each owner is judged by its best streaming rate over its latest chunks against the median of the
other owners' best rates. A chunk's rate is timed from its first bytes to its last (PieceTiming), not
from the request: a holder sends a chunk on its way there as its bytes arrive, so an owner slow to
get it (a slow download) streams it as slowly as one with a slow upload, while the wait before it
starts is the learner's pace, alike for every owner (timed from the request on loopback, where that
wait is all there is, one owner in five was passed over on equal links). An owner OWNER_SLOW_RATIO
times below that median is passed over: its stripe's chunks come from whole holders. A whole holder
sends each chunk once and sends later requesters to the peer that took it (takers.Takers), so a
slow owner costs the learner about one stripe more (1/n of a copy for n sharers). Medians, not the
learner's rate: a peer whose own download is slow finds every owner slow alike and passes none
over, and a busy machine's stalls slow all owners alike. At most a quarter of the owners (and at
least two) are passed over by one fetch, whatever they do, which bounds what the learner can be
made to send.

Measured (benchmarks/fanout_wan.py, the same one-slow-owner run, one run each on the quiet machine):
the seven others took the snapshot in 26.4 s (judged after 2 chunks, ratio 4: the defaults), 21.2 s
(2 chunks, ratio 3) and 32.3 s (3 chunks, ratio 3), against 48.9 s before; on equal links the
learner sent 1.0 copies with the defaults and 1.2 with ratio 3 (owners passed over wrongly). A
delta's stripes are 4-5 chunks each, too few to judge within one: its payload 9.0-11.3 s against 10.5 s.
So a peer keeps its owners' paces across its fetches (a follower's one OwnerPace): an owner judged
slow in an earlier fetch (a snapshot's long stripes, or two short ones) is passed over as the next
fetch starts. Its old paces are forgotten after OWNER_MEMORY fetches, and it is then tried again.
Measured the same way (GEPO_FANOUT_DELTAS=4, one run, busy cores): the seven others held each
delta's payload in 3.1, 4.0, 2.8 and 5.4 s, against 8.3, 7.8, 7.1 and 8.3 s before and 2.6 s on
equal links; the learner sent 1.2 copies of each delta (1.1 before).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque

logger = logging.getLogger(__name__)

# an owner delivering below 1/OWNER_SLOW_RATIO of the other owners' median is passed over. At 100
# Mbit/s each owner's uplink is shared by the n - 1 peers fetching its stripe: a 20 Mbit/s one is
# 5x slower than the others for each of them, and a busy machine's stall slows one request, not an
# owner's best over several
OWNER_SLOW_RATIO = 4.0
OWNER_WINDOW = 4  # an owner's best rate is taken over this many of its latest chunks
OWNER_JUDGED_CHUNKS = 2  # chunks from an owner before it is judged: its first may come as slowly as the learner sends them
OWNERS_JUDGED_BY = 2  # other owners with a rate before any owner is judged against them
# at most one owner in OWNERS_PASSED_SHARE is passed over in one fetch, and at least OWNERS_PASSED_MIN
# may be: one owner passed over wrongly (a loaded machine's stall) must not leave a slow one in place
OWNERS_PASSED_SHARE = 4
OWNERS_PASSED_MIN = 2
# fetches in stripes an owner's paces are kept for: one judged slow is passed over from the start of the fetches
# after (a delta's stripes are too short to judge it within one) until its paces are this old, then
# tried again. A volunteer's slow uplink lasts; a wrong judgment (a loaded machine's stall) costs the
# learner one stripe a fetch meanwhile
OWNER_MEMORY = 8


# a chunk whose bytes after its first piece came within this long came in a burst (from a holder's
# buffers, or on loopback): reckoned over this long, a rate it was at least as fast as (a 32 KiB
# piece: 3.3 MB/s, above a 100 Mbit/s owner's share for each of 7 peers, 1.8 MB/s)
MIN_STREAM_S = 0.01


class PieceTiming:
    """Hears a chunk's pieces as they come (a fetch's `heard`): when its first came, how many bytes
    that was, and when the last came."""

    def __init__(self) -> None:
        self.first_at: float | None = None
        self.first_bytes = self.total = 0
        self.last_at = 0.0

    def __call__(self, piece: bytes) -> None:
        now = time.monotonic()
        if self.first_at is None:
            self.first_at, self.first_bytes = now, len(piece)
        self.total += len(piece)
        self.last_at = now

    def rate(self) -> float | None:
        """Bytes per second after the first piece (None: it came in one piece, which says nothing of a pace)."""
        rest = self.total - self.first_bytes
        if self.first_at is None or rest <= 0:
            return None
        return rest / max(self.last_at - self.first_at, MIN_STREAM_S)


class OwnerPace:
    """Per owner: the paces of its latest chunks (bytes per second, from their first piece to their
    last), over this peer's last OWNER_MEMORY fetches in stripes (`begin` counts them)."""

    def __init__(self) -> None:
        self._rates: dict[str, deque[tuple[int, float]]] = {}  # owner -> (fetch, rate) of its latest chunks
        self._fetch = 0
        self._lock = threading.Lock()

    def begin(self) -> None:
        """A fetch starts: paces from OWNER_MEMORY fetches ago and before are forgotten."""
        with self._lock:
            self._fetch += 1
            for owner in list(self._rates):
                rates = self._rates[owner]
                while rates and rates[0][0] <= self._fetch - OWNER_MEMORY:
                    rates.popleft()
                if not rates:
                    del self._rates[owner]

    def arrived(self, owner: str, rate: float) -> None:
        with self._lock:
            self._rates.setdefault(owner, deque(maxlen=OWNER_WINDOW)).append((self._fetch, rate))

    def slow(self, owner: str) -> tuple[float, float] | None:
        """(`owner`'s best recent rate, the other owners' median) when it is far slower than the
        others; None while it is not, or while there is too little to tell."""
        with self._lock:
            mine = [rate for _, rate in self._rates.get(owner, ())]
            others = [max(rate for _, rate in rates) for peer, rates in self._rates.items() if peer != owner and rates]
        if len(mine) < OWNER_JUDGED_CHUNKS or len(others) < OWNERS_JUDGED_BY:
            return None
        best, median = max(mine), statistics.median(others)
        return (best, median) if best * OWNER_SLOW_RATIO < median else None

    def slowest(self, owners: list[str], at_most: int) -> list[str]:
        """Of `owners`, up to `at_most` judged slow on what is known now, the slowest first."""
        found = [(judged[0], owner) for owner in owners if (judged := self.slow(owner)) is not None]
        return [owner for _, owner in sorted(found)[:at_most]]


class PassingOwnersOver:
    """The part of a chunked fetch (chunked_fetch.ChunkedFetch, which holds the state these read)
    that judges stripes' owners and takes a slow owner's stripe from whole holders."""

    def _owners_passed_at_most(self) -> int:
        return max(OWNERS_PASSED_MIN, len(self.sharers) // OWNERS_PASSED_SHARE)

    def _pass_remembered_owners(self) -> list[str]:
        """As stripes start: the owners judged slow in this peer's earlier fetches, passed over before
        any of their chunks is asked for (their stripes then come from whole holders)."""
        self.owner_pace.begin()
        owners = [p for p in self.sharers if p != self.me and p not in self._dead]
        passed = self.owner_pace.slowest(owners, self._owners_passed_at_most())
        with self._cond:
            self._dead.update(passed)
            self.slow_owners.update(passed)
        if passed:
            logger.info("taking the stripes of %s of %s %d from whole holders: slow in earlier fetches",
                        ", ".join(passed), self.spec.kind, self.spec.version)
        return passed

    def _judge_owner(self, owner: str, timing: PieceTiming) -> None:
        """In stripes, after a chunk from `owner` came (`timing`: how its pieces came)."""
        rate = timing.rate()
        if rate is None:
            return
        self.owner_pace.arrived(owner, rate)
        found = self.owner_pace.slow(owner)
        if found is None:
            return
        with self._cond:
            if owner in self._dead or len(self.slow_owners) >= self._owners_passed_at_most():
                return
            self._dead.add(owner)
            self.slow_owners.add(owner)
            # its stripe's chunks not asked for yet, and those asked of it now (their requests end at
            # its pace), go to the whole holders' workers, in the order they were to be asked
            stuck = {i for i, peer in self._asking if peer == owner and not self.partial.have[i]}
            moved = [i for i in self._from_owners if self.owner(i) == owner]
            for index in moved:
                self._from_owners.remove(index)
            self._from_whole.extend(i for i in sorted(stuck) + moved if i not in self._from_whole)
            self._cond.notify_all()
        best, median = found
        logger.info("taking %s's stripe of %s %d from whole holders: it delivers %.2f MB/s, the other owners %.2f MB/s",
                    owner, self.spec.kind, self.spec.version, best / 1e6, median / 1e6)
        self._start_worker(True)  # its stripe is as much again as this peer's own from whole holders
