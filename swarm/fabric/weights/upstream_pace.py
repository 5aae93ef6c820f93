"""How fast a chain's upstream passes a payload on, and when to ask the peer before it instead.

Along a chain every peer fetches at the pace of the slowest hop before it. A snapshot's chain is in
peer id order (new samplers have reported no fetch the learner could order it by), so one slow link
early in it held every peer after it to its pace: 8 new samplers took a 98.6 MB snapshot in 45-50 s
with a 20 Mbit/s sampler fourth, against 12.6 s with every link at 100 Mbit/s. Passed over, the seven
others took it in 1.06x the time on equal links (18.4 s against 17.4 s in one process, on a busy
machine where it was 51.0 s against 20.5 s before: benchmarks/fanout_wan.py, GEPO_FANOUT_SLOW_PLACE).

The peer right after a slow one sees it first: its upstream's chunks come slowly. Whether the slow
hop is its upstream's download (pass it over) or a hop further up (passing it over gains nothing)
shows in one request: the peer before the upstream (`before`: the learner for the chain's second
peer) is asked for a chunk with no wait. If that peer sends it PASS_RATIO times as fast as the
upstream's throughput, twice in a row (PASSES), the upstream is passed over: the chain goes on from that peer, the slow
one hangs off it as a leaf (taking its share of that peer's uplink, which upload_slots.UploadSlots
bounds: a freed slot goes to the requester holding the fewest), and no peer after the slow one waits
for it again.

The probe asks for a chunk PROBE_AHEAD places beyond the next one in this peer's queue (with
SHARED_WORKERS requests in flight, about 16 past what it holds), with no wait: along a chain of
equal links every peer is within a chunk or two of the one before it, so the peer before the
upstream does not hold it yet and answers busy at once, costing no bytes. Only a peer far ahead of
the upstream holds it, which is what passing the upstream over needs: one held up behind a slow
download further up (the upstream's upstream is then as far behind) is never passed for it.

Throughput, not a request's time: a chain peer keeps SHARED_WORKERS requests in flight at its
upstream, so each request's time includes the queue before it, and a peer held up behind a slow hop
would look slow to the peer after it in turn (the cascade that split an earlier try's chain into a
tree: CHANGELOG, "Tried and left out"). A probe is a chunk the peer needs anyway; one answered busy
is asked again after twice as many chunks as the last (BUSY_BACKOFF), so equal links cost a few
busy answers per fetch, and at most PROBES probes per upstream are answered.

The peer before the upstream may be slow too: a slow uplink right before a slow download holds the
chunks far ahead of it, but sends them as slowly. Probes that find it so (WALK_RATIO, WALK_AFTER)
go one peer further up (at the top, to the learner), and passing over then passes every peer
between: the peers after a slow download behind a slow uplink had fetched at their pace. So do
probes that settle nothing, busy for not holding the chunk or sending it neither fast enough to pass
the upstream nor as slowly (WALK_AFTER_UNSURE: two slow downloads side by side), until an answer
finds the upstream keeping up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque

from swarm.fabric.weights.chunks import answer_limit
from swarm.fabric.weights.delta import CorruptVersion
from swarm.fabric.weights.upload_slots import HolderBusy, NotHeldYet

logger = logging.getLogger(__name__)

# chunks from an upstream (after its first, or since its last probe) before its throughput is judged:
# with two probes needed (PASSES), 4 held the peers after a slow one to its pace for 11.5 s of a
# snapshot (the seven others 24.6 s against 14.3 s on equal links)
PROBE_AFTER_CHUNKS = 2
PROBE_MIN_S = 0.3  # ... over at least this long: a few chunks in a burst say little of a link
PROBE_AHEAD = 8  # the probe's chunk: this many places into the queue of chunks not asked for yet
# probes in a row whose peer (the one before the upstream) holds the chunk but sends it no faster than
# WALK_RATIO times the upstream's throughput, after which the probes ask the peer before that one:
# its uplink is as slow as the upstream. Any probe short of PASS_RATIO (or one that ran out of time)
# was too loose a sign: on loopback beside the suite's other lane, a peer walked up past a healthy
# head, passed it over with the slow one, and had the learner send it a second copy
WALK_AFTER = 2
WALK_RATIO = 1.5
# probes answered at most per upstream in one fetch (each costs a request). Answered busy, a probe is
# not counted: busy answers used the probes up early in a snapshot, while a slow uplink further up
# held the whole chain back and the peer before a slow download was not yet far ahead of it, and the
# four peers after the slow download fetched at its pace (45.7 s against 18.7 s for the peer before
# it: benchmarks/fanout_wan.py, GEPO_FANOUT_SLOW_DOWN_MBIT). Instead each busy answer in a row
# doubles the chunks before the next probe (up to BUSY_BACKOFF times), which keeps them few on equal links
PROBES = 5
BUSY_BACKOFF = 3
# probes of the peer before the upstream that settle nothing, after which the probes ask the one
# before it. Two slow downloads side by side: the second one's download is as slow as its
# upstream's, so it never passes the first (its probes come at its own pace), and the peer after both
# finds the first no further ahead than the second, or sending what it holds (its uplink shared with
# the second's requests) at 2-3.6 MB/s against the upstream's 1.2-2.0: answered busy, or between
# WALK_RATIO and PASS_RATIO, or not in time, it fetched at their pace to the end (benchmarks/fanout_wan.py,
# GEPO_FANOUT_SLOW_DOWN_PLACES=2,3: the others 48.4 s, as the slow ones; 26.4-34.5 s walking). Such probes (`unsure`)
# walk up; one further up that is far ahead passes both over. Busy answers for want of upload slots
# are not unsure (NotHeldYet tells them apart: one that holds no slot, which a slow requester's
# transfers hold, may be far ahead; counted, the peer after a slow download walked up past a healthy
# head on loopback and passed both over). On equal links the probes walk up too (every peer before is
# a chunk or two ahead, and busy), so the first answer that finds the upstream keeping up (under
# WALK_RATIO) settles it: the probes step back down and walk no more on unsure probes (each chunk a
# walked probe takes from the learner is one more it sends)
WALK_AFTER_UNSURE = 3
# probes in a row that must each find the upstream slow, its throughput reckoned afresh for each
# (over the chunks since the one before): a peer held up behind a slow hop that was then passed over
# catches up at once, and one probe timed while it still lagged had the peer after it pass it over
# too (the cascade: the seven others 24.2 s against 18.4 s). A probe answered busy (the peer before
# does not hold its chunk yet: the upstream keeps up with it) ends the run too: counted neither way,
# it let such a cascade through in the loopback test
PASSES = 2
# a peer before the upstream that sends a chunk this many times as fast as the upstream's throughput
# passes it on: the upstream is passed over. A probe shares that peer's uplink with the upstream's
# own flow: at 100 Mbit/s, a 20 Mbit/s upstream measured 1.6-2.0 MB/s against probes of 10-13 MB/s
# (timed from their first bytes: the wait for a slot the slow one holds there made them look as slow,
# 2.2-2.6 MB/s). No probe outruns the link (12.5 MB/s at 100 Mbit/s), so an upstream faster than a
# third of the link is never passed over
PASS_RATIO = 3.0
WINDOW = 16  # at most the chunks an upstream's throughput is reckoned over (those since the last probe)


class UpstreamPace:
    """Per upstream: when its chunks arrived since it was last probed (its throughput), how often it
    was probed, how many probes in a row found it slow, and whether a probe is under way now (one
    at a time per fetch)."""

    def __init__(self) -> None:
        self._arrivals: dict[str, deque[tuple[float, int]]] = {}
        self._steady: dict[str, deque[tuple[float, int]]] = {}  # the same, never cut at a probe
        self._probes: Counter[str] = Counter()
        self._since_probe: Counter[str] = Counter()
        self._slow_in_a_row: Counter[str] = Counter()
        self._further: Counter[str] = Counter()  # peers beyond the one before each upstream its probes skip
        self._sent_slowly: Counter[str] = Counter()  # probes in a row whose peer sent too slowly to pass the upstream
        self._busy_in_a_row: Counter[str] = Counter()  # probes in a row answered busy
        self._unsure_here: Counter[str] = Counter()  # probes that settled nothing since the last walk up
        self._walked_unsure: Counter[str] = Counter()  # peers walked past for such probes
        self._settled: set[str] = set()  # upstreams whose probes walk no more for them
        self._probing = False
        self._lock = threading.Lock()

    def arrived(self, upstream: str, size: int) -> None:
        """A chunk of `size` bytes from `upstream` was kept."""
        with self._lock:
            now = time.monotonic()
            self._arrivals.setdefault(upstream, deque(maxlen=WINDOW)).append((now, size))
            self._steady.setdefault(upstream, deque(maxlen=WINDOW)).append((now, size))
            self._since_probe[upstream] += 1

    def steady(self, upstream: str) -> float | None:
        """Bytes per second from `upstream` over its last WINDOW chunks, whenever probed (None: too
        few): what a probe that may settle the walk is held against. Over the chunks since the last
        probe alone, a slow download that had a few chunks in hand passed them on at its uplink's
        pace (8.2 MB/s behind a 20 Mbit/s line), and a walked probe found it keeping up."""
        with self._lock:
            return self._throughput(upstream, self._steady)

    def _throughput(self, upstream: str, kept: dict | None = None) -> float | None:
        """Bytes per second from `upstream` over its latest chunks (None: too few, or too short a spell)."""
        arrivals = (self._arrivals if kept is None else kept).get(upstream)
        if arrivals is None or len(arrivals) < PROBE_AFTER_CHUNKS + 1:
            return None
        span = arrivals[-1][0] - arrivals[0][0]
        if span < PROBE_MIN_S:
            return None
        return sum(size for _, size in list(arrivals)[1:]) / span  # the first chunk's bytes came before the span

    def start_probe(self, upstream: str) -> float | None:
        """The throughput of `upstream` to test a probe against, when it is time to probe (the caller
        then calls `end_probe`); None otherwise."""
        with self._lock:
            spacing = PROBE_AFTER_CHUNKS << min(self._busy_in_a_row[upstream], BUSY_BACKOFF)
            if self._probing or self._probes[upstream] >= PROBES or self._since_probe[upstream] < spacing:
                return None
            rate = self._throughput(upstream)
            if rate is None:
                return None
            self._probing = True
            self._probes[upstream] += 1
            self._since_probe[upstream] = 0
            arrivals = self._arrivals[upstream]
            while len(arrivals) > 1:  # the next probe's throughput: from the last chunk here on
                arrivals.popleft()
            return rate

    def further(self, upstream: str) -> int:
        """How many peers up from the one before `upstream` its next probe skips (walk_up)."""
        with self._lock:
            return self._further[upstream]

    def sent_slowly(self, upstream: str, *, reset: bool = False) -> None:
        """The probed peer held a chunk far ahead of `upstream` but sent it about as slowly (`reset`:
        a probe that found otherwise): after WALK_AFTER such probes in a row, that peer's uplink is
        taken for slow too, and the next probes ask the peer before it (at the top, the learner)."""
        with self._lock:
            if reset:
                self._sent_slowly[upstream] = 0
                return
            self._sent_slowly[upstream] += 1
            if self._sent_slowly[upstream] >= WALK_AFTER:
                self._sent_slowly[upstream] = 0
                self._further[upstream] += 1

    def end_probe(self, upstream: str, slow: bool, *, busy: bool = False, unsure: bool = False,
                  kept_up: bool = False) -> bool:
        """A probe of the peer before `upstream` ended, finding `upstream` `slow` or not (`busy`: the
        peer before answered busy, which is not counted against PROBES; `unsure`: it settled nothing,
        WALK_AFTER_UNSURE; `kept_up`: the chunk came under WALK_RATIO times the upstream's steady
        throughput): whether PASSES probes in a row found it slow (pass it over)."""
        with self._lock:
            self._probing = False
            self._slow_in_a_row[upstream] = self._slow_in_a_row[upstream] + 1 if slow else 0
            if busy:
                self._probes[upstream] -= 1
                self._busy_in_a_row[upstream] += 1
            else:
                self._busy_in_a_row[upstream] = 0
            if kept_up:
                self._unsure_here[upstream] = 0
                if self._walked_unsure[upstream]:  # the upstream keeps up with that peer too: settled
                    self._further[upstream] -= self._walked_unsure[upstream]
                    self._walked_unsure[upstream] = 0
                    self._settled.add(upstream)
            elif unsure and upstream not in self._settled:
                self._unsure_here[upstream] += 1
                if self._unsure_here[upstream] >= WALK_AFTER_UNSURE:
                    self._unsure_here[upstream] = 0
                    self._walked_unsure[upstream] += 1
                    self._further[upstream] += 1
                    self._probes[upstream] = 0  # the peer walked to has PROBES of its own (PASSES need two)
                    self._busy_in_a_row[upstream] = min(self._busy_in_a_row[upstream], 1)  # (the peer walked to is asked sooner)
            return self._slow_in_a_row[upstream] >= PASSES


# the shortest spell from a probe's first bytes to its last that its rate is reckoned over: bytes a
# loaded peer's process reads late come at once from its daemon's buffers (a 20 Mbit/s peer timed a
# 256 KiB chunk's rest at 20.8 MB/s, and passed its fast upstream over for that), so a shorter spell
# is reckoned from the request instead
MIN_TIMED_S = 0.05


def probe_rate(size: int, started: float, ended: float, first_at: float, first_bytes: int) -> float:
    """Bytes per second of a probe of `size` bytes asked at `started`, whose first `first_bytes`
    came at `first_at` and the rest by `ended`: from its first bytes on (the wait for a slot at a
    holder whose slots a slow requester holds is no sign of its uplink's pace), or over the whole
    request when nearly all came at once or the rest within MIN_TIMED_S."""
    if first_bytes < size // 2 and ended - first_at >= MIN_TIMED_S:
        return (size - first_bytes) / (ended - first_at)
    return size / max(ended - started, 1e-6)


# a probe's round trips on loaded cores and its wait for a slot (a slow requester's chunk going out:
# 0.42 s for 1 MiB at 20 Mbit/s), on top of its bytes' time at the rate that would pass
PROBE_GRACE_S = 1.0


def probe_deadline(throughput: float, size: int) -> float:
    """How long a probe for a chunk of `size` bytes may take (longer, and it would not pass the
    upstream over by much: it is given up, and the upstream kept)."""
    return PROBE_GRACE_S + size / (PASS_RATIO * throughput)


class PassingOver:
    """The part of a chunked fetch (chunked_fetch.ChunkedFetch, which holds the state these read)
    that judges a chain's upstream and passes a slow one over."""

    def _judge_upstream(self, upstream: str) -> None:
        """In a chain, after a chunk from `upstream`: now and then (UpstreamPace), a chunk well ahead
        of those asked for (upstream_pace.PROBE_AHEAD) is asked of the peer before it, with no wait;
        one that holds it and sends it far faster than `upstream` passes chunks on
        (upstream_pace.PASS_RATIO) has it pass `upstream` over."""
        above = self._above(upstream) if upstream == self.upstream() else []
        skip = self.pace.further(upstream)
        before = above[min(skip, len(above) - 1)] if above else None
        throughput = self.pace.start_probe(upstream) if before is not None else None
        if throughput is None:
            return
        ok, rate, index, passing, busy, unheld = False, 0.0, None, False, False, False
        try:
            with self._cond:
                queued = [i for i in self._from_owners if not self.partial.have[i]]
                if not queued:
                    return
                index = queued[min(PROBE_AHEAD, len(queued) - 1)]
                self._from_owners.remove(index)
                self._busy += 1
            size = answer_limit(self.spec, index)
            first: list[tuple[float, int]] = []  # when the probe's first bytes came, and how many

            def timed(piece: bytes) -> None:
                if not first:
                    first.append((time.monotonic(), len(piece)))
            started = time.monotonic()
            try:  # with `force`: a whole holder sends it whoever took it (a redirect would say nothing of its pace)
                data = self.client.piece(before, self.spec, index, 0.0, force=True, relays=self.relays, sink=timed,
                                         timeout_s=probe_deadline(throughput, size))
                ended = time.monotonic()
                ok = self._keep(before, index, data)
            except CorruptVersion as exc:
                self._strike(before, exc)
            except HolderBusy as exc:  # it does not hold the chunk yet (or has no slot): the upstream keeps up
                busy, unheld = True, isinstance(exc, NotHeldYet)
                logger.debug("probe of %s for chunk %d: busy (%s)", before, index, exc)
            except Exception as exc:  # noqa: BLE001  a probe that fails or runs out of time says nothing against anyone
                logger.debug("probe of %s for chunk %d failed: %s: %s", before, index, type(exc).__name__, exc)
            if ok:
                rate = probe_rate(size, started, ended, *(first[0] if first else (started, 0)))
        finally:
            slow = ok and rate >= PASS_RATIO * throughput
            steady = self.pace.steady(upstream)
            kept_up = ok and rate < WALK_RATIO * (steady if steady is not None else throughput)
            # unsure: it settled nothing (none at the top of the chain: nobody is further up to walk to,
            # and each walk gives the next peer PROBES of its own; none where no chunk was asked for)
            unsure = index is not None and before != above[-1] and (unheld or not (busy or slow or kept_up))
            passing = self.pace.end_probe(upstream, slow, busy=busy, kept_up=kept_up, unsure=unsure)
            if ok and rate < WALK_RATIO * throughput and before != above[-1]:
                # it held the chunk far ahead but sent it as slowly as the upstream: its uplink is a slow
                # hop too, and the chain's peer before it may be far faster (a slow download right
                # behind a slow uplink: the peers after both fetched at their pace, 46 s against 19)
                self.pace.sent_slowly(upstream)
            elif not busy:
                self.pace.sent_slowly(upstream, reset=True)
            if index is not None:
                self._done(index, None)
                if not ok:  # back in its place: the chain's chunks are asked for in order
                    with self._cond:
                        self._from_owners.insert(sum(1 for i in self._from_owners if i < index), index)
        logger.debug("probe of %s for chunk %d of %s %d: %s; %s's throughput %.2f MB/s", before, index, self.spec.kind,
                     self.spec.version, f"{rate / 1e6:.2f} MB/s" if ok else "not sent", upstream, throughput / 1e6)
        if passing:  # `upstream`, and the peers between it and `before`, whose uplinks were too slow
            why = f"{throughput / 1e6:.2f} MB/s, against {rate / 1e6:.2f} MB/s from {before}"
            for peer in [upstream, *above[:above.index(before)]]:
                self._pass_over(peer, why)

    def _above(self, upstream: str) -> list[str]:
        """The chain's peers before `upstream` that are not passed over, nearest first, then the last
        whole holder (the learner): the peers a probe may ask, in the order it walks up."""
        with self._cond:
            place = self.sharers.index(upstream) if upstream in self.sharers else 0
            found = [p for p in reversed(self.sharers[:place]) if p not in self._dead]
            if self.whole and self.whole[-1] not in self._dead:
                found.append(self.whole[-1])
            return found

    def _pass_over(self, upstream: str, why: str) -> None:
        """`upstream` passes chunks on far slower than the peer before it: the chain goes on from that
        peer. The chunks asked of `upstream` are asked of it too, by workers of their own (the
        requests waiting on `upstream` end at its pace), which retire as the others finish."""
        logger.info("passing %s over in the chain of %s %d: %s", upstream, self.spec.kind, self.spec.version, why)
        with self._cond:
            self._dead.add(upstream)
            self.passed_over.add(upstream)
            stuck = sorted(i for i, peer in self._asking if peer == upstream and not self.partial.have[i])
            for index in reversed(stuck):
                if index not in self._from_owners:
                    self._from_owners.appendleft(index)
            self._surplus += len(stuck)
            self._cond.notify_all()
        for _ in stuck:
            self._start_worker(False)
