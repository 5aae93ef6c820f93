"""One payload fetched in chunks from many peers at once, and passed on while it arrives.

Peers that fetch the same payload at the same time share the work out, as pipelined broadcast
does. Up to CHAIN_MAX of them pass it along a chain, in the sharers' order (a delta's: as the
learner named them, slow links last, swarm.fabric.membership.link_judge; else sorted by peer id): the first
fetches every chunk from peers that hold the whole payload (relays first, the learner last), and
each of the others fetches every chunk, in order, from the one before it (`upstream`), which passes
it on as its bytes arrive (swarm.fabric.weights.chunks: a holder waits a few seconds for a chunk on its way,
then sends its bytes as they come, the last one once the chunk verified there). Every link then
carries one flow at its full rate: the learner uploads one copy, every other uplink and every
downlink one, and the last peer holds the payload one transfer time plus a forward piece and a
one-way delay per hop after the first started. A peer before this one that leaves, misses chunks or
sends corrupt data is passed over for the one before it (or the whole holders), and so is one far
slower than the peer before it (swarm.fabric.weights.upstream_pace: a slow link early in a
snapshot's chain, in peer id order, held every peer after it to its pace).

More sharers deal the chunks out round-robin (stripes, the scatter-then-gather scheme): each
fetches its own stripe from whole holders and every other chunk from the peer whose stripe it is,
which passes it on as its bytes arrive, round by round and each round from the owner after it on
(`turn`), so that no owner is asked by every peer at once: two hops whatever the number of peers,
but each owner's uplink and downlink carry n-1 flows at once, which share them less evenly (8
samplers at 50 Mbit/s: links about 60% full, against 68% along a chain in the same hour). An owner
far slower than the others has its stripe taken from whole holders (swarm.fabric.weights.owner_pace).
Either way the learner uploads about one copy however many peers fetch.

Who shares a payload: swarm.fabric.weights.sharer_view (for a delta, named by the learner in its
signed announcement, so that every sampler makes the same chain or stripes without a lookup).
Views differ by a heartbeat at most, so nothing depends on them being right: a peer
asked for a chunk it is not fetching itself fetches it next from a whole holder (`_adopt`: two
peers that each take the other for a chunk's owner would otherwise both wait out OWNER_WAIT_S);
a chunk whose owner does not deliver within its wait or cannot be reached is fetched from a whole
holder instead; an owner that is busy (its upload slots taken, or too many requests waiting on
it) is asked again shortly; and a chunk that does not verify is refetched from another peer while
the sender is struck (`on_corrupt`: the follower shuns it as it does a holder of a corrupt
version). Holders hand out their upload slots to the requester holding the fewest, then to the one served
least so far (upload_slots.UploadSlots), so every stripe arrives at the same pace, and a peer whose own stripe is
done puts its whole-holder workers on the owners' chunks, so the last chunks have more requests in
flight. A whole holder that sent a chunk to a relaying peer already sends later requesters there
(takers.Takers): they ask that peer, and the holder again with `force` only if it fails them, so
plans that differ (adopted chunks, owners passed over) cost the learner about one copy all the same.

Peers named by records and redirects are data, never trusted (issue 45): one whose id does not
parse, or whose request raises anything at all, is struck and shunned, never raising out of the
fetch; whole holders other than the learner, and the peers a holder redirects to, are judged by
their delivery rate against the learner's (source_judging.SLOW_RATIO): too slow, they are given up on within a
bounded time and struck, and the chunk comes from the holder. A holder sends one requester to one
taker for at most half a payload's chunks (takers.REDIRECT_SHARE), whatever the requester does.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter, deque
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Callable

from swarm.fabric.membership.records import dialable_peer_id
from swarm.fabric.weights.chunks import ChunkBook, ChunkSpec, Partial, answer_limit
from swarm.fabric.weights.takers import Redirected
from swarm.fabric.weights.delta import CorruptVersion
from swarm.fabric.weights.owner_pace import OwnerPace, PassingOwnersOver, PieceTiming
from swarm.fabric.weights.source_judging import SourceJudging
from swarm.fabric.weights.upload_slots import HolderBusy
from swarm.fabric.weights.upstream_pace import PassingOver, UpstreamPace
from swarm.fabric.weights.versions import send_deadline

logger = logging.getLogger(__name__)


OWNER_WAIT_S = 8.0  # how long a stripe's owner may take to have a chunk (it fetches its stripe in order)
OWNER_MISSES = 2  # owners that miss this many chunks are passed over for the rest of the fetch
OWNER_BUSY = 20  # busy answers in a row from an owner after which its chunks are fetched from whole holders
WHOLE_WORKERS = 2  # requests at once to whole holders by a peer fetching alone (the learner's default upload slots)
# ... and by each of several sharers (for its own stripe): their requests together keep the learner's uplink busy, and
# one at a time each owner's stripe comes chunk by chunk at its share of that uplink instead of
# two chunks at half of it, so the chunks the other sharers wait for reach their owners sooner
# (8 samplers, 100 Mbit/s, 9.7 MB delta: the first chunks reached their owners 0.15-0.3 s after
# they were asked for, not 0.23-0.55 s; payload 1.41, 1.42 s against 1.54-1.63 s with two)
SHARED_WHOLE_WORKERS = 1
# sharers that pass a payload along a chain (more: stripes). Each link of a chain carries one
# transfer at the link's full rate, but every hop is on the way of every peer after it: it adds a
# forward piece (chunks.forward_piece_bytes), the link's one-way delay (no netem here: not measured)
# and any stall of the peer's CPU. 8 samplers (benchmarks/fanout_wan.py, hivemind, median of the
# deltas): at 25 Mbit/s the delta in 1.34x one sampler's time (stripes 1.43x), the snapshot 1.34x
# (1.86x); at 50 Mbit/s 1.38x-1.50x (1.49x-1.63x); at 100 Mbit/s, where the two shared cores were
# 98% busy, 2.23x (1.87x). 8 is the longest chain measured
CHAIN_MAX = 8
SHARED_WORKERS = 8  # requests at once to other stripes' owners (a chain's upstream): a round's worth among 8 sharers (4 left owners idle)
RETRY_S = (0.05, 0.25)  # the wait before asking again when every whole holder is busy
WHOLE_FAILURES = 3  # a whole holder that times out or cannot be reached this often is not asked again
# ... and a sharer: one time-out on a loaded machine (2 cores, a dozen peers) is no sign it left,
# and passing it over at once sent every chunk it had taken again from the learner (1.58 copies
# where 1.02 are usual); a gone sharer costs one more failed request
SHARER_FAILURES = 2
STALL_S = 15.0  # a fetch that gains no chunk for this long stops (the version is then fetched whole)
# how long the peer a whole holder redirects to may take to have the chunk (it took it from that
# holder a moment ago, or is taking it now)
REDIRECT_WAIT_S = 4.0


class ChunkedFetchFailed(RuntimeError):
    """The payload could not be assembled (no holder left, or out of time); nothing was used."""


@dataclass
class ChunkSources:
    whole: list[str]  # peers holding the whole payload, in the order to ask them (the learner last)
    sharers: list[str]  # peers fetching it now, this one included when it relays: the stripes' owners
    # sharers this peer does not ask (they sent it corrupt data lately): they keep their stripes, as
    # every other peer deals them alike, and this one fetches their chunks from whole holders
    avoid: frozenset[str] = frozenset()


class ChunkedFetch(PassingOver, PassingOwnersOver, SourceJudging):
    """Fetches `spec`'s payload into a Partial registered in `book` (served to others as it fills)."""

    def __init__(self, client, book: ChunkBook, spec: ChunkSpec, sources: ChunkSources, me: str, *,
                 unreachable: tuple[type[BaseException], ...], on_corrupt: Callable[[str, BaseException], None],
                 on_unreachable: Callable[[str, BaseException], None] | None = None,
                 rng: random.Random | None = None, deadline_s: float | None = None,
                 on_chunk: Callable[[int], None] | None = None, manifest: Future | None = None,
                 chain: bool | None = None, owner_pace: OwnerPace | None = None) -> None:
        self.client, self.book, self.spec, self.me = client, book, spec, me
        self._asked_manifest = manifest  # the last whole holder's (the learner's) answer, asked already
        self.on_chunk = on_chunk  # hears the size of each verified chunk kept (from a worker thread): progress
        self.whole = list(sources.whole)
        self.sharers = list(sources.sharers)
        self.unreachable, self.on_corrupt, self.on_unreachable = unreachable, on_corrupt, on_unreachable
        self.rng = rng or random.Random()
        self.deadline = time.monotonic() + (deadline_s or send_deadline(spec.size) * 2)
        self.received: Counter[str] = Counter()  # bytes of verified chunks, per sender
        self._dead: set[str] = set(sources.avoid) - {me}  # peers not asked (again) in this fetch
        self._misses: Counter[str] = Counter()
        self._failures: Counter[str] = Counter()
        self._busy_answers: Counter[str] = Counter()
        self._busy_in_a_row: Counter[str] = Counter()  # since the peer last delivered a chunk
        self.rates: dict[str, float] = {}  # the best delivery rate of each source (bytes per second)
        self.slow: set[str] = set()  # sources struck for delivering too slowly
        self._on_trial: set[str] = set()  # redirect targets with no rate yet and a request in flight
        self._progress = time.monotonic()  # when the last chunk was kept
        self._cond = threading.Condition()
        self._from_whole: deque[int] = deque()
        self._from_owners: deque[int] = deque()
        self._busy = 0  # workers in a request
        self._inflight: set[int] = set()  # chunks a worker is fetching from a whole holder now
        self._asking: set[tuple[int, str]] = set()  # (chunk, sharer) of the requests to sharers in flight
        self.pace = UpstreamPace()  # how fast a chain's upstream passes chunks on
        self.passed_over: set[str] = set()  # upstreams passed over for being far slower than the peer before them
        # how fast each stripe's owner delivers (a follower's: kept across its fetches)
        self.owner_pace = owner_pace if owner_pace is not None else OwnerPace()
        self.slow_owners: set[str] = set()  # owners whose stripes come from whole holders, for being far slower than the others
        self._workers: list[threading.Thread] = []
        self._surplus = 0  # workers started for a passed-over upstream's chunks, to retire once through
        self.adopted = 0  # chunks fetched from whole holders because another peer asked for them
        self.redirected = 0  # chunk requests a whole holder sent to the peer it had sent the chunk to
        self.relays = me in self.sharers  # this peer serves what it receives (holders may send others here)
        # a chain when few peers share (chain=None: up to CHAIN_MAX), stripes beyond; a peer that does not
        # relay takes each chunk from its stripe's owner either way (every sharer gets every chunk)
        shared = self.relays and len(self.sharers) > 1
        self.chain = shared and (len(self.sharers) <= CHAIN_MAX if chain is None else chain)
        self._position = self.sharers.index(me) if self.relays else -1
        # a chain's head (first, or every peer before it avoided) takes the whole payload from whole
        # holders, as a peer fetching alone
        heads = self.chain and self.upstream() is None
        self.whole_workers = SHARED_WHOLE_WORKERS if shared and not heads else WHOLE_WORKERS
        # the owner this peer asks first in each round (turn): the one after it, or any when it does not share
        self._first_owner = self._position + 1 if self.relays else self.rng.randrange(len(self.sharers) or 1)
        self.partial: Partial | None = None
        self.finished = False  # the fetch has returned: requests still out end unheard

    def owner(self, index: int) -> str | None:
        """The sharer to ask for chunk `index` (this peer: from whole holders; None: no sharers)."""
        if self.chain:
            return self.upstream() or self.me
        return self.sharers[index % len(self.sharers)] if self.sharers else None

    def upstream(self) -> str | None:
        """In a chain: the nearest sharer before this one that is not passed over (None: this peer
        heads the chain, or every peer before it left). Always one before it in the sharers' order,
        which every sharer reads alike (the learner's signed list, or the peer ids sorted), so chunks
        passed on while they arrive never wait in a circle."""
        with self._cond:
            return next((p for p in reversed(self.sharers[:max(self._position, 0)]) if p not in self._dead), None)

    def turn(self, index: int) -> tuple[int, int]:
        """When to ask for chunk `index`: round by round (an owner fetches its stripe in order, one
        chunk per round), each round from the owner after this peer on. Were every peer to ask in
        index order, all would queue at the same few owners at once while the other owners' uplinks
        sat idle; rotated, each owner serves about as many requests as any other at every moment
        (the rotated order of ring all-gathers)."""
        if not self.sharers or self.chain:
            return index, 0  # a chain: in order, as its upstream receives them
        lap, owner = divmod(index, len(self.sharers))
        return lap, (owner - self._first_owner) % len(self.sharers)

    def run(self) -> Partial:
        """The complete, verified payload (a Partial still served from `book`: call book.end(it)
        once the version is in the store). Raises ChunkedFetchFailed."""
        manifest = self._manifest()
        passed = self._pass_remembered_owners() if self.sharers and not self.chain else []
        # the queues first: a peer asking for a chunk the moment the partial is served must find its
        # index queued already, or adopting it would queue it a second time (two workers, two copies)
        for index in sorted(range(self.spec.count), key=self.turn):
            owner = self.owner(index)
            (self._from_whole if owner in (None, self.me, *passed) else self._from_owners).append(index)
        self.partial = partial = self.book.begin(self.spec, *manifest, wanted=self._adopt)
        try:
            # a passed-over owner's stripe is as much again as this peer's own from whole holders
            for whole in [True] * (self.whole_workers + len(passed)) + [False] * SHARED_WORKERS:
                self._start_worker(whole)
            self._wait_for_workers()
            if not partial.complete:
                raise ChunkedFetchFailed(f"{partial.missing} of {self.spec.count} chunks of {self.spec.kind} "
                                         f"{self.spec.version} could not be fetched (whole holders left: "
                                         f"{len(self._alive())} of {len(self.whole)}; busy answers: "
                                         f"{sum(self._busy_answers.values())}, failures: {sum(self._failures.values())}, "
                                         f"misses: {sum(self._misses.values())})")
            return partial
        except BaseException:
            self.book.end(partial)
            raise

    def _wait_for_workers(self) -> None:
        """Until the payload is complete, or every worker is through. A worker still in a request
        then (to an upstream or an owner passed over for being slow, whose answer comes at its pace)
        is left to end by itself: nothing it brings is needed, and nothing it meets is held against
        anyone (`finished`). Joined, such requests held the four peers that had passed a slow owner
        over until it delivered: 3.4 s, where their payloads were complete after 1.2 s."""
        with self._cond:
            while not self.partial.complete and time.monotonic() < self.deadline + 5:
                if not any(worker.is_alive() for worker in self._workers):  # (passing over adds workers meanwhile)
                    break
                self._cond.wait(0.1)
            self.finished = True

    def _start_worker(self, whole: bool) -> None:
        worker = threading.Thread(target=self._work, args=(whole,), daemon=True, name="chunk-fetch")
        with self._cond:
            self._workers.append(worker)
        worker.start()

    def _manifest(self) -> tuple[bytes, list[bytes]]:
        """The manifest from the first whole holder (then sharer) that sends one matching the root:
        the learner's answer first when it was asked already. A second round when none sent it: a
        loaded whole holder may time out once (as for chunks: WHOLE_FAILURES), and with the learner
        the only one, that would fail the whole fetch. A sharer that failed in the first round is not
        asked again (a gone one would cost a second time-out before any chunk is asked for)."""
        ask = [(peer, None) for peer in self.whole + [p for p in self.sharers if p != self.me] if dialable_peer_id(peer)]
        asked = [(self.whole[-1], self._asked_manifest)] if self._asked_manifest is not None and self.whole else []
        for again, round_ in enumerate((asked + ask, ask)):
            if again:
                time.sleep(self.rng.uniform(*RETRY_S))
            for peer, answer in round_:
                skip = peer in self._dead or again and peer not in self.whole and self._failures[peer] > 0
                found = None if skip else self._manifest_from(peer, answer)
                if found is not None:
                    return found
        raise ChunkedFetchFailed(f"no peer sent the manifest of {self.spec.kind} {self.spec.version}")

    def _manifest_from(self, peer: str, answer: Future | None) -> tuple[bytes, list[bytes]] | None:
        """(manifest, digests) from `peer` (`answer`: its reply to a request sent already), or None."""
        try:
            if answer is not None:
                manifest = answer.result(timeout=max(0.0, self.deadline - time.monotonic()))
            else:
                manifest = self.client.piece(peer, self.spec, None, 0.0 if peer in self.whole else OWNER_WAIT_S)
            return manifest, self.spec.digests(manifest, peer)
        except CorruptVersion as exc:
            self._strike(peer, exc)
        except (KeyError, HolderBusy, CancelledError) as exc:  # cancelled: the follower is closing
            logger.debug("no manifest of %s %d from %s: %s", self.spec.kind, self.spec.version, peer, exc)
        except self.unreachable + (TimeoutError,) as exc:
            self._gone(peer, exc)
        except Exception as exc:  # noqa: BLE001  an id that does not parse, an answer the client cannot take
            self._unusable(peer, exc)
        return None

    def _alive(self) -> list[str]:
        return [p for p in self.whole if p not in self._dead]

    def _next(self, whole: bool) -> tuple[int, bool] | None:
        """(the next chunk for a worker, whether to take it from a whole holder); None when there is
        nothing left for the worker to do. A whole holders' worker with none of those chunks left
        helps with the owners' (the end of a fetch: more requests in flight for its last chunks)."""
        with self._cond:
            while time.monotonic() < min(self.deadline, self._progress + STALL_S) and not self.partial.complete:
                if whole and not self._alive():
                    return None  # no whole holder left to ask: the chunks queued for them cannot come
                for queue in (self._from_whole, self._from_owners) if whole else (self._from_owners,):
                    while queue and self.partial.have[queue[0]]:
                        queue.popleft()
                    if queue:
                        self._busy += 1
                        index = queue.popleft()
                        if queue is self._from_whole:
                            self._inflight.add(index)
                        return index, queue is self._from_whole
                if not whole and not self._from_owners:
                    return None  # the owners' chunks are all handed out; the whole holders' workers finish
                if whole and not self._from_owners and self._busy == 0 and not self._from_whole:
                    return None
                self._cond.wait(0.2)
            return None

    def _adopt(self, index: int) -> None:
        """Another peer waits for chunk `index` from this one, which meant to take it from some other
        peer: fetch it from a whole holder next (peers whose records differ by a heartbeat can each
        take the other for the chunk's owner)."""
        if self.chain:
            return  # every chunk comes here in order: the requester's wait ends when it does
        with self._cond:  # (from the weight server's threads as soon as `begin` serves the partial)
            if index in self._inflight or index in self._from_whole or self.partial is not None and self.partial.have[index]:
                return
            self._from_whole.appendleft(index)
            self.adopted += 1
            self._cond.notify_all()

    def _done(self, index: int, requeue: deque | None, *, front: bool = False) -> None:
        """A worker is through with chunk `index`; unless it is here, it goes back to `requeue` (at
        the front for a whole holder that was busy: a stripe is fetched in order, as the peers
        waiting for its chunks expect)."""
        with self._cond:
            self._busy -= 1
            self._inflight.discard(index)
            if requeue is not None and not self.partial.have[index]:
                requeue.appendleft(index) if front else requeue.append(index)
            self._cond.notify_all()

    def _work(self, whole: bool) -> None:
        while (job := self._next(whole)) is not None:
            index, from_whole = job
            owner = None if from_whole else self.owner(index)
            # a chain whose peers before this one all left: this one heads it now, with every worker
            if from_whole or owner == self.me:
                ok = self._fetch_whole(index)
                self._done(index, None if ok else self._from_whole, front=True)
                if not ok:  # every whole holder busy (or failing): a moment for a slot to free
                    time.sleep(self.rng.uniform(*RETRY_S))
            else:
                with self._cond:
                    self._asking.add((index, owner))
                timing = None if self.chain else PieceTiming()
                try:
                    ok = self._try(owner, index, OWNER_WAIT_S, heard=timing) if owner not in self._dead else False
                finally:
                    with self._cond:
                        self._asking.discard((index, owner))
                if ok is None and self._busy_in_a_row[owner] <= OWNER_BUSY:  # on its way there: ask it again shortly
                    self._done(index, self._from_owners, front=self.chain)  # a chain's upstream sends in order
                    time.sleep(self.rng.uniform(*RETRY_S))
                    continue
                # not from its owner: from a whole holder (a passed-over upstream's: from the chain's peer before it)
                passed = owner in self.passed_over
                self._done(index, None if ok else self._from_owners if passed else self._from_whole, front=passed)
                if ok and self.chain:
                    self.pace.arrived(owner, answer_limit(self.spec, index))
                    self._judge_upstream(owner)
                elif ok:
                    self._judge_owner(owner, timing)
            with self._cond:
                if self._surplus > 0 and not whole:
                    self._surplus -= 1
                    return

    def _fetch_whole(self, index: int) -> bool:
        relays = [p for p in self.whole[:-1] if p not in self._dead]
        self.rng.shuffle(relays)  # in a random order each time: the load spreads
        learner = [p for p in self.whole[-1:] if p not in self._dead]
        if learner and self._reference() is None:
            # no rate to judge relays (and the peers it redirects to) by yet: the learner first,
            # with `force`, so that its rate is known (a chunk or two of one copy)
            return any(self._try(peer, index, 0.0, force=peer in learner) is True for peer in learner + relays)
        return any(self._try(peer, index, 0.0, judged=peer not in learner) is True for peer in relays + learner)

    def _try(self, peer: str, index: int, wait_s: float, *, force: bool = False, judged: bool = False,
             heard: Callable[[bytes], None] | None = None) -> bool | None:
        """True: chunk `index` from `peer` is kept; None: `peer` was busy; False: it failed.
        `judged`: `peer` is a source judged by its rate (SLOW_RATIO): too slow, it is struck.
        `heard`: hears each piece of the chunk's bytes as they come (when they are not passed on)."""
        if not dialable_peer_id(peer):  # a holder named by a record or a redirect: data, never trusted
            self._unusable(peer, ValueError(f"{str(peer)[:64]!r} is not a peer id"))
            return False
        size = answer_limit(self.spec, index)
        limit = self._judge_deadline(size) if judged else None
        started = time.monotonic()
        try:
            return self._try_once(peer, index, wait_s, force=force, limit=limit, started=started, heard=heard)
        except self.unreachable as exc:
            if limit is not None and time.monotonic() - started >= 0.9 * limit:
                self._slow_source(peer, f"no chunk of {size} bytes in {limit:.2f}s ({type(exc).__name__})")
            else:
                self._gone(peer, exc)
            return False
        except Exception as exc:  # noqa: BLE001  whatever a source does, it never raises out of a fetch
            self._unusable(peer, exc)
            return False

    def _try_once(self, peer: str, index: int, wait_s: float, *, force: bool, limit: float | None,
                  started: float, heard: Callable[[bytes], None] | None) -> bool | None:
        # a relaying peer passes a chunk from a whole holder or its chain's upstream on while it
        # arrives (peers may be waiting for it here); one from a stripe's owner only once it is here:
        # two sharers that each take the other for its owner would otherwise each wait to pass on
        # what the other has not got (a chain's upstream is always before this peer in every view)
        passes_on = peer in self.whole or self.chain and peer == self.upstream()
        sink = self.partial.receiving(index) if self.relays and passes_on else None
        try:
            data = self.client.piece(peer, self.spec, index, wait_s, force=force, relays=self.relays, sink=sink if sink is not None else heard,
                                     timeout_s=limit)
            if not self._keep(peer, index, data):
                return False
            self._rated(peer, len(data), time.monotonic() - started, judged=limit is not None)
            return True
        except Redirected as exc:
            if sink is not None:  # the chunk comes through another request now: that one passes it on
                self.partial.received(index)
                sink = None
            return self._redirected(peer, exc.target, index) if not force else False
        except HolderBusy:
            self._busy_answers[peer] += 1
            self._busy_in_a_row[peer] += 1
            return None
        except CorruptVersion as exc:
            self._strike(peer, exc)
            return False
        except KeyError as exc:  # not held (yet): an owner that keeps missing is passed over
            logger.debug("chunk %d of %s %d not at %s: %s", index, self.spec.kind, self.spec.version, peer, exc)
            self._misses[peer] += 1
            if peer not in self.whole and self._misses[peer] >= OWNER_MISSES or peer in self.whole:
                self._dead.add(peer)
            return False
        finally:
            if sink is not None:
                self.partial.received(index)

    def _keep(self, peer: str, index: int, data: bytes) -> bool:
        if not self.partial.put(index, data):
            self._strike(peer, CorruptVersion(f"chunk {index} of {self.spec.kind} {self.spec.version} does not match "
                                              "its digest"))
            return False
        with self._cond:
            self._busy_in_a_row[peer] = 0
            self.received[peer] += len(data)
            self._progress = time.monotonic()
        if self.on_chunk is not None and not self.finished:
            self.on_chunk(len(data))
        return True

    def _unusable(self, peer: str, exc: BaseException) -> None:
        """`peer` cannot be asked at all (an id that does not parse, an answer the client could not
        take): passed over at once, and shunned, whatever it raised."""
        logger.warning("peer %s cannot serve chunks of %s %d: %s: %s", str(peer)[:64], self.spec.kind, self.spec.version,
                       type(exc).__name__, exc)
        with self._cond:
            self._failures[peer] += 1
            self._dead.add(peer)
        if self.on_unreachable is not None and not self.finished:
            self.on_unreachable(peer, exc)

    def _redirected(self, holder: str, target: str, index: int) -> bool | None:
        """`holder` sent chunk `index` to `target` already: from `target` (asked with `force`, so
        that redirects do not chain; judged by its rate), else from `holder` with `force` (the
        target failed, is gone, too slow, is this peer, or kept saying busy)."""
        with self._cond:
            self.redirected += 1
            # a target not rated yet gets one request at a time: while it is on trial, the other
            # workers' chunks come from the holder (a slow one costs one request's wait, not every worker's)
            trial = target not in self.rates
            ask = target != self.me and target not in self._dead and not (trial and target in self._on_trial)
            if ask and trial:
                self._on_trial.add(target)
        if ask:
            try:
                got = self._try(target, index, REDIRECT_WAIT_S, force=True, judged=True)
            finally:
                if trial:
                    with self._cond:
                        self._on_trial.discard(target)
            if got is True:
                return True
            if got is None and self._busy_in_a_row[target] <= OWNER_BUSY:
                return None  # it has the chunk or will shortly: ask again in a moment
        return self._try(holder, index, 0.0, force=True)

    def _strike(self, peer: str, exc: BaseException) -> None:
        logger.warning("peer %s sent a chunk that does not verify: %s", peer, exc)
        self._dead.add(peer)
        self.on_corrupt(peer, exc)

    def _gone(self, peer: str, exc: BaseException) -> None:
        logger.info("peer %s could not serve chunks of %s %d: %s: %s", peer, self.spec.kind, self.spec.version,
                    type(exc).__name__, exc)
        with self._cond:  # workers fail at once: no count may be lost
            self._failures[peer] += 1
            if self._failures[peer] >= (WHOLE_FAILURES if peer in self.whole else SHARER_FAILURES):
                self._dead.add(peer)
        if self.on_unreachable is not None and not self.finished:
            self.on_unreachable(peer, exc)
