"""How a sampler keeps up with the learner's versions: a background thread polls the announcements
signed by the learner keys it was given and fetches each new version into a `VersionStore`, so
generation pauses only for the weight swap itself.

Versions are relayed: every peer serves the versions it holds and lists them in its membership
record (`holds`), and a sampler fetches a new version from other holders first, in random order so
that the load spreads, and from the learner that announced it last. Holders limit how many
transfers they serve at once (the learner's upload budget); a busy holder is passed over for the
next, and when all are busy the sampler asks again shortly, by when the peers that fetched it
first serve it too. Every payload is checked against the hash the learner signed, so a relay can
delay a version but never change it: a holder that sends one that does not verify is shunned for
a while and the version is fetched from another. A follower asked for a chunk of a version newer
than any it has seen looks at the announcements at once (`nudge`): a peer that starts on a version
asks the others for their stripes straight away, so they start a round trip or two after the
first, not up to a poll later.

For experiments on one machine, the pickup of a version can be delayed by a random number of
seconds (`pickup_delay`, the paper's log-normal latency model) and generation can lag a fixed
number of versions behind (`lag_steps`): see `usable_version`.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Sequence

from swarm.config.learner_keys import encode_learner_key
from swarm.fabric.membership.authority import key_fingerprint
from swarm.fabric.membership.records import believable_holds, dialable_peer_id
from swarm.fabric.weights.announcement_push import read_push
from swarm.fabric.weights.announcements import Announced
from swarm.fabric.weights.chunked_fetch import ChunkedFetch, ChunkedFetchFailed, ChunkSources
from swarm.fabric.weights.owner_pace import OwnerPace
from swarm.fabric.weights.sharer_view import delta_base, sharers_for
from swarm.fabric.weights.chunks import ChunkSpec
from swarm.fabric.weights.delta import CorruptVersion
from swarm.fabric.weights.upload_slots import HolderBusy
from swarm.fabric.weights.versions import FetchResult, VersionStore
from swarm.progress import Progress, ProgressTask

logger = logging.getLogger(__name__)


SHUN_S = 300.0  # how long a holder that served a version that does not verify is not asked again
UNREACHABLE_SHUN_S = 60.0  # how long a holder that could not be reached (or timed out) is not asked again
MAX_RELAYS_TRIED = 3  # relays asked per attempt before the learner: a swarm of fake holders costs a few dials, not N
BUSY_RETRY_S = (0.2, 0.6)  # when every holder is busy: ask again after a random wait in this range, doubling
BUSY_RETRY_MAX_S = 5.0  # with each busy round in a row, up to this
PROGRESS_AFTER_S = 2.0  # a fetch shows its progress once it has taken this long (deltas of small models never do)
NUDGE_GAP_S = 0.05  # a nudged look at the announcements comes at least this long after the last (a flood costs little)
# a relay's attempt at a whole version is bounded (the learner's is not: it is the last resort),
# so that stalling relays (MAX_RELAYS_TRIED of them) delay the learner by a bounded time: the
# version's size at the slowest rate a relay is worth waiting for, plus a grace for the round
# trips and the holder's encoding, and never more than RELAY_CAP_S (a quarter of a client's 120 s)
RELAY_MIN_BYTES_PER_S = 4 * 1024 * 1024  # a relay slower than this for a whole version: the learner is better
RELAY_GRACE_S = 5.0
RELAY_CAP_S = 30.0  # also what the relays of one fetch get together
RELAY_LEAST_S = 1.0  # a relay is not asked with less time left than this


def relay_deadline(size: int | None) -> float:
    """Seconds a relay gets to send a whole version of about `size` bytes (None: not known)."""
    if size is None:
        return RELAY_CAP_S
    return min(RELAY_GRACE_S + max(size, 0) / RELAY_MIN_BYTES_PER_S, RELAY_CAP_S)


def holders_for(announcement: Announced, members: Iterable = (), *, me: str = "", rng: random.Random | None = None,
                shunned: Callable[[str], bool] = lambda peer: False, newest: int | None = None) -> list[str]:
    """The peers to fetch an announced version from, in the order to try them: up to
    MAX_RELAYS_TRIED other members that hold it, drawn at random (spreading the load), then the
    learner that announced it, always. A record is believed only as far as `believable_holds` goes
    (`newest`: the newest version announced, the announcement's by default): one naming a peer id
    that cannot be dialled, or versions not out yet, names no holder."""
    relays = sorted({m.record.peer_id for m in members
                     if announcement.version in (believable_holds(m.record, announcement.version if newest is None else newest) or ())
                     and m.record.peer_id not in (me, announcement.peer_id) and not shunned(m.record.peer_id)})
    (rng or random).shuffle(relays)
    return relays[:MAX_RELAYS_TRIED] + [announcement.peer_id]


def fetch_from_holders(client, holders: Sequence[str], want: int, want_hash: str, store: VersionStore,
                       unreachable: tuple[type[BaseException], ...],
                       on_corrupt: Callable[[str, BaseException], None] | None = None,
                       known: dict[int, str] | None = None,
                       on_unreachable: Callable[[str, BaseException], None] | None = None,
                       relay_timeout_s: float | None = None, learner: str | None = None) -> FetchResult:
    """Version `want` from the first holder that serves it whole and verified. Raises HolderBusy
    when the first holder to refuse was busy and no later one failed otherwise, else the last
    holder's error (nothing is added to `store` then). `on_corrupt(holder, error)` hears of each holder that sent a version that does
    not verify, `on_unreachable` of each that could not be reached or missed its deadline; `known`:
    signed hashes of recent versions (RebuildingClient.fetch). `relay_timeout_s`: the limit on each
    attempt of a holder other than `learner` (the relays: `relay_deadline`), so a relay that stalls
    costs that long, not the client's whole timeout; the learner, the last resort, gets it all. The
    relays together get at most RELAY_CAP_S: the learner is asked within that of the start."""
    if not holders:
        raise ValueError("no holder to fetch from")
    failure: BaseException | None = None
    relays_until = time.monotonic() + RELAY_CAP_S
    for holder in holders:
        bounded = relay_timeout_s is not None and holder != learner
        try:
            if bounded:
                limit = min(relay_timeout_s, relays_until - time.monotonic())
                if limit < RELAY_LEAST_S:
                    continue  # the relays' time is spent: on to the learner
                return client.fetch(holder, want, want_hash, store, known, timeout_s=limit)
            return client.fetch(holder, want, want_hash, store, known)
        except HolderBusy as exc:
            failure = failure or exc
        except CorruptVersion as exc:
            logger.warning("holder %s sent a version %d that does not verify: %s", holder, want, exc)
            if on_corrupt is not None:
                on_corrupt(holder, exc)
            failure = exc
        except KeyError as exc:  # it does not hold the version (any more): try the next
            logger.info("holder %s could not serve version %d: %s", holder, want, exc)
            failure = exc
        except Exception as exc:  # noqa: BLE001  fault-tolerance boundary: gone, a transfer cut, an id that
            # does not parse (a record is data): whatever one holder raises, the next (the learner last) is asked
            log = logger.info if isinstance(exc, unreachable) else logger.warning
            log("holder %s could not serve version %d%s: %s: %s", str(holder)[:64], want,
                f" within {limit:.0f}s" if bounded else "", type(exc).__name__, exc)
            if on_unreachable is not None:
                on_unreachable(holder, exc)
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
    `store` (deltas when it can) from the peers that hold it (`holders_for`), stamping each with
    the time it may be used. `on_fetch` gets each FetchResult (from the follower's thread); a
    failed fetch, whatever the holder did, is reported (the 1st, 10th and every 100th time in a
    row) and retried at the next poll; `last_error` keeps the latest, for `diagnose`."""

    def __init__(self, fabric, store: VersionStore, learner_keys: list[bytes], delay, rng: random.Random, *,
                 echo: Callable[[str], None], on_fetch: Callable[[FetchResult], None] | None = None,
                 poll_s: float = 1.0, max_payload_bytes: int | None = None, relay: bool = True,
                 chunked: bool = True, progress: Progress | None = None) -> None:
        self.fabric, self.store, self.keys, self.delay, self.rng, self.echo = fabric, store, learner_keys, delay, rng, echo
        self.progress = progress  # hears the bytes of a fetch that takes a while
        self.on_fetch, self.poll_s, self.relay, self.chunked = on_fetch, poll_s, relay, chunked and relay
        self.client = fabric.weight_client(**({"max_payload_bytes": max_payload_bytes} if max_payload_bytes else {}))
        # round trips run beside the one the follower waits for: the manifest while the members are
        # looked up, and after a nudge the members while the announcements are
        self._aside = ThreadPoolExecutor(2, thread_name_prefix="follower-aside")
        self.ready_at: dict[int, float] = {}
        self.newest: int | None = None  # newest version announced
        self.learner_peer: str | None = None  # the peer that announced it
        self.learner_peers: tuple[str, ...] = ()  # every learner announcing it: where rollouts may go
        self.sampling = None  # the run's sampling settings (RunSampling), as last announced
        self.ended = False  # the newest announcement says the run has ended (its learner trained its last step)
        self.last_error: str | None = None  # why the last fetch failed (None after a success)
        self.stop = threading.Event()
        self._wake = threading.Event()  # set by `nudge`: look at the announcements now, not at the next poll
        self._members_aside = False  # set by a nudge for a snapshot: look the members up beside the announcements
        self._failures = 0
        self._chunk_failures = 0
        self._shunned: dict[str, float] = {}  # holder -> until when it is not asked
        self._struck: dict[str, float] = {}  # of those, the ones that sent data that does not verify
        # stripes' owners' paces across fetches: one slow in a snapshot's stripes is passed over as
        # each delta after it starts (a delta's stripes are too short to judge it in)
        self.owner_pace = OwnerPace()
        self._pushed: Announced | None = None  # a learner's pushed announcement, newer than the newest seen
        self._push_lock = threading.Lock()
        store.book.on_unheld = self.nudge
        store.book.on_pushed = self.pushed
        self._thread = threading.Thread(target=self._run, name="version-follower", daemon=True)
        self._thread.start()

    def nudge(self, kind: str, version: int) -> None:
        """A peer asked this one for a payload of `version`: when that is newer than the newest
        announced one seen here, another peer started fetching a version this one has not seen yet
        (it asks its stripes' owners at once). Looking at the announcements now instead of at the
        next poll starts every sharer within a round trip of the first, not up to a poll later."""
        if self.newest is None or version > self.newest:
            # a snapshot's sharers are read from the members; a delta's come named in its announcement
            self._members_aside = self._members_aside or kind == "snapshot"
            self._wake.set()

    def pushed(self, request: dict) -> bool:
        """A learner pushed its announcement here (announcement_push): when it verifies and names a
        version newer than any seen here, that version is fetched now, neither a poll nor a lookup
        later. False when it does not verify."""
        ann = read_push(request, self.keys, self.fabric.run_id)
        if ann is None or self._revoked(request.get("owner")):
            return False
        with self._push_lock:
            if (self.newest is None or ann.version > self.newest) and (self._pushed is None or ann.version > self._pushed.version):
                self._pushed = ann
                self._wake.set()
        return True

    def _revoked(self, owner) -> bool:
        """Whether a certified learner's key `owner` is on the run owner's revocation list (the
        DHT's lookups leave such announcements out: a pushed one must be, too)."""
        revoked = getattr(self.fabric, "revoked", None)
        if revoked is None or owner in self.keys or not isinstance(owner, bytes):
            return False
        try:
            return key_fingerprint(owner) in revoked(self.keys)
        except Exception:  # noqa: BLE001  no answer about the list: the DHT poll leaves revoked keys out anyway
            return False

    def _take_pushed(self) -> Announced | None:
        with self._push_lock:
            pushed, self._pushed = self._pushed, None
        return pushed if pushed is not None and (self.newest is None or pushed.version > self.newest) else None

    def shunned(self) -> list[str]:
        """The peers not asked for versions now (they sent corrupt data or did not answer)."""
        now = time.monotonic()
        return sorted(peer for peer, until in list(self._shunned.items()) if until > now)

    def _is_shunned(self, peer: str) -> bool:
        return self._shunned.get(peer, 0.0) > time.monotonic()

    def _is_struck(self, peer: str) -> bool:
        return self._struck.get(peer, 0.0) > time.monotonic()

    def _shun(self, peer: str, exc: BaseException) -> None:
        self._shunned[peer] = self._struck[peer] = time.monotonic() + SHUN_S
        self.echo(f"holder {peer} sent a version that does not verify ({exc}); not asking it for {SHUN_S:.0f}s")

    def _unreachable(self, peer: str, exc: BaseException) -> None:
        if peer != self.learner_peer:  # the learner is always asked: it may be restarting
            self._shunned[peer] = max(self._shunned.get(peer, 0.0), time.monotonic() + UNREACHABLE_SHUN_S)

    def _task(self, label: str, total: int | None) -> ProgressTask | None:
        if self.progress is None:
            return None
        return self.progress.task(label, total, unit="bytes", delay_s=PROGRESS_AFTER_S)

    def _members(self) -> list:
        if not self.relay:
            return []
        try:
            return self.fabric.members()
        except Exception as exc:  # noqa: BLE001  no listing: fetch from the learner alone
            logger.debug("member lookup failed: %s", exc)
            return []

    def _listing(self, pending: Future | None) -> list:
        """The members: `pending`'s answer (a lookup begun already), else looked up now."""
        return pending.result() if pending is not None else self._members()

    def _fetch(self, ann: Announced, unreachable, members: Future | None = None) -> FetchResult:
        """The announced version from its holders; when they are all busy, the newest of the
        versions just before it (their hashes are signed in the same announcement) that a relay
        holds and that is newer than what this peer has: while the newest spreads, a sampler moves
        on from relays instead of waiting in line at the learner. `members`: their lookup, begun
        already (after a nudge for a snapshot)."""
        spec = self._chunk_spec(ann) if self.chunked else None
        # the manifest from the learner while the membership lookup runs: in turn, these two round
        # trips put the last of 8 samplers' first chunk 0.5 s after an announcement (0.26 s alone)
        manifest = self._aside.submit(self.client.piece, ann.peer_id, spec, None, 0.0) if spec else None
        # a delta whose sharers the learner named needs no lookup: nobody else holds a version just
        # announced, and the named sharers own the stripes (the members are looked up only if the
        # chunks fail and the version is fetched whole)
        named = list(ann.sharers) if spec is not None and spec.kind == "delta" and ann.sharers else None
        listed = self._listing(members) if named is None else []
        chunked = self._fetch_chunked(ann, spec, listed, unreachable, manifest, named) if spec else None
        if chunked is not None:
            return chunked
        if named is not None:
            listed = self._listing(members)
        holders = holders_for(ann, listed, me=self.fabric.peer_id, rng=self.rng, shunned=self._is_shunned)
        task = self._task(f"fetching version {ann.version}", None)
        self.client.on_received = task.advance if task is not None else None
        # the snapshot is the largest a whole version can be; a relay gets the time it takes at a useful rate
        snapshot = ann.chunks.get("snapshot") if ann.chunks else None
        deadline = relay_deadline(snapshot.size if snapshot is not None else None)
        try:
            return fetch_from_holders(self.client, holders, ann.version, ann.hash, self.store, unreachable,
                                      on_corrupt=self._shun, known=ann.recent, on_unreachable=self._unreachable,
                                      relay_timeout_s=deadline, learner=ann.peer_id)
        except HolderBusy:
            mine = self.store.latest if self.store.latest is not None else -1
            for version in sorted((v for v in ann.recent if v > mine), reverse=True):
                older = Announced(version, ann.recent[version], ann.peer_id, ann.sampling)
                relays = holders_for(older, listed, me=self.fabric.peer_id, rng=self.rng, shunned=self._is_shunned,
                                     newest=ann.version)[:-1]
                if relays:
                    return fetch_from_holders(self.client, relays, version, older.hash, self.store, unreachable,
                                              on_corrupt=self._shun, known=ann.recent, on_unreachable=self._unreachable,
                                              relay_timeout_s=deadline, learner=ann.peer_id)
            raise
        finally:
            self.client.on_received = None
            if task is not None:
                task.close()

    def _chunk_spec(self, ann: Announced) -> ChunkSpec | None:
        """The payload to fetch in chunks: the delta when this peer holds the version before the
        announced one, the snapshot when it holds none, if the learner announced it chunked."""
        latest = self.store.latest
        kind = "snapshot" if latest is None else "delta" if latest == delta_base(ann) else None
        spec = ann.chunks.get(kind) if kind else None
        return None if spec is None or spec.size > self.client.max_payload_bytes else spec

    def _fetch_chunked(self, ann: Announced, spec: ChunkSpec, members: list, unreachable,
                       manifest: Future | None = None, named: list[str] | None = None) -> FetchResult | None:
        """The announced version in chunks (`spec`: _chunk_spec), shared out with the peers fetching
        it too (ChunkedFetch); `manifest`: the learner's answer to a manifest request, on its way;
        `named`: the sharers the learner named (else they are read from `members`). None when it
        fails: the caller fetches the version whole."""
        latest, kind = self.store.latest, spec.kind
        me = self.fabric.peer_id
        relays = holders_for(ann, members, me=me, rng=self.rng, shunned=self._is_shunned)[:-1]
        # every peer deals the stripes out among the same sharers, shunned ones included (dropping one
        # here would move nearly every chunk to another owner in this peer's plan alone). Those that
        # sent corrupt data are not asked: their stripes come from whole holders. One that failed to
        # answer lately (a stream reset or time-out on a loaded peer) is asked again: the fetch
        # passes it over at its second failure (SHARER_FAILURES), and otherwise the learner would send its stripe again
        # in the learner's order (a chain's: slow links last), the same list at every sampler; else sorted
        sharers = ([p for p in dict.fromkeys(named) if dialable_peer_id(p)] if named is not None
                   else sharers_for(spec, members, me=me, me_relays=self.fabric.dialable, base=delta_base(ann)))
        avoid = frozenset(p for p in sharers if p != me and self._is_struck(p))
        started = time.time()
        task = self._task(f"fetching the {kind} of version {ann.version}", spec.size)
        fetch = ChunkedFetch(self.client, self.store.book, spec, ChunkSources(relays + [ann.peer_id], sharers, avoid), me,
                             unreachable=unreachable, on_corrupt=self._shun, on_unreachable=self._unreachable, rng=self.rng,
                             on_chunk=task.advance if task is not None else None, manifest=manifest,
                             owner_pace=self.owner_pace)
        try:
            partial = fetch.run()
        except ChunkedFetchFailed as exc:
            self._chunk_failures += 1
            log = self.echo if self._chunk_failures in (1, 10) or self._chunk_failures % 100 == 0 else logger.info
            log(f"version {ann.version} in chunks failed ({exc}); fetching it whole")
            return None
        finally:
            if task is not None:
                task.close()
        try:
            result = self.client.rebuild(max(fetch.received, key=fetch.received.get), latest if kind == "delta" else None,
                                         [partial.payload()], ann.version, ann.hash, self.store, ann.recent, started)
        except CorruptVersion as exc:  # chunks that match the signed root, and still not the version
            logger.warning("version %d assembled from chunks does not verify (%s); fetching it whole", ann.version, exc)
            return None
        finally:
            self.store.book.end(partial)
        result.sources, result.passed_over = dict(fetch.received), sorted(fetch.passed_over)
        return result

    def _run(self) -> None:
        unreachable = self.fabric.unreachable_errors()
        busy_in_a_row, nudged = 0, False
        while not self.stop.is_set():
            self._wake.clear()  # a nudge from now on brings the next look forward
            looked = time.monotonic()
            # nudged for a snapshot: one is out that this peer has not seen, so the members (who
            # shares it) are looked up beside the announcements rather than after them
            aside, self._members_aside = nudged and self._members_aside, False
            members, nudged = self._aside.submit(self._members) if aside else None, False
            pushed = self._take_pushed()
            try:
                ann = pushed or self.fabric.latest_announced(self.keys)
            except Exception as exc:  # noqa: BLE001  a lookup hiccup: try again next poll
                logger.debug("announcement lookup failed: %s", exc)
                ann = None
            if ann is not None:
                self.newest, self.learner_peer, self.sampling = ann.version, ann.peer_id, ann.sampling
                self.ended = ann.ended
                peers = ann.peers or (ann.peer_id,)
                # a push names only the learner that sent it: any other learner announcing the version
                # stays where rollouts may go until the next look (right after the fetch)
                self.learner_peers = tuple(sorted(set(self.learner_peers) | set(peers))) if ann is pushed else peers
                if self.store.latest is None or ann.version > self.store.latest:
                    try:
                        fetched = self._fetch(ann, unreachable, members)
                    except HolderBusy as exc:  # the version is spreading: ask again soon, no failure
                        busy_in_a_row += 1
                        self.last_error = str(exc)
                        backoff = min(BUSY_RETRY_MAX_S, self.rng.uniform(*BUSY_RETRY_S) * 2 ** min(busy_in_a_row - 1, 8))
                        self.stop.wait(backoff)
                        continue
                    except Exception as exc:  # noqa: BLE001  fault-tolerance boundary: whatever a holder did, retry
                        self._failures += 1
                        self.last_error = f"{type(exc).__name__}: {exc}"
                        if self._failures in (1, 10) or self._failures % 100 == 0:
                            self.echo(f"could not fetch version {ann.version} ({self.last_error}); retrying")
                    else:
                        busy_in_a_row = 0
                        fetched.relayed = any(peer != ann.peer_id for peer in fetched.sources or [fetched.holder])
                        self._fetched(fetched)
                        if fetched.version < ann.version:
                            self.stop.wait(self.rng.uniform(*BUSY_RETRY_S))  # the newest is still spreading
                        continue  # look again at once: the learner may be further ahead already
            nudged = self._wake.wait(self.poll_s)
            if nudged and self._pushed is None:  # (a push is taken at once: it needs no look)
                self.stop.wait(max(0.0, looked + NUDGE_GAP_S - time.monotonic()))

    def _fetched(self, fetched: FetchResult) -> None:
        self._failures, self.last_error = 0, None
        ready = time.time() + self.delay.draw(self.rng)
        with self.store.lock:
            for v in self.store.states:
                self.ready_at.setdefault(v, ready)
        if self.on_fetch and not self.stop.is_set():  # (a fetch that outlived `halt`'s wait is not reported)
            try:
                self.on_fetch(fetched)
            except Exception as exc:  # noqa: BLE001  reporting must never stop the following
                logger.warning("reporting version %d failed: %s", fetched.version, exc)

    def usable(self, lag_steps: int, *, have_one: bool) -> int | None:
        with self.store.lock:
            return usable_version(list(self.store.states), self.ready_at, self.newest, lag_steps, time.time(), have_one=have_one)

    def diagnose(self, run_id: str) -> str:
        """Why no version has arrived, in words a volunteer can act on."""

        if self.newest is not None:
            return (f"version {self.newest} is announced by learner {self.learner_peer}, but no holder could serve it "
                    f"({self.last_error or 'no attempt finished yet'}); check that this machine can reach the learner "
                    "(a learner behind a NAT needs --auto-relay over hivemind, or --announce-addr with a forwarded port)")
        try:
            learners = [m for m in self.fabric.members() if m.record.role == "learner"]
        except Exception as exc:  # noqa: BLE001
            return f"the swarm could not be listed ({type(exc).__name__}: {exc}); check --peers"
        if not learners:
            return (f"no learner has joined run '{run_id}': start `swarm learner` with the same --run-id and --peers, "
                    "or check --run-id")
        ours = [m for m in learners if m.owner in set(self.keys)]
        if not ours:
            theirs = ", ".join(encode_learner_key(m.owner)[:24] + "..." for m in learners[:3])
            return (f"{len(learners)} learner(s) run in '{run_id}', but under other keys (theirs begin {theirs}); "
                    "--learner-key must be the key the learner prints (or --learner-key-file RUN_DIR/learner.key)")
        return f"learner {ours[0].record.peer_id} has joined but announced no version yet (it may still be loading)"

    def halt(self) -> None:
        """Stops polling and fetching: once it returns, `on_fetch` is called no more (a peer writes its
        last event after this). Safe to call again; `close` calls it."""
        self.stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    def close(self) -> None:
        self.halt()
        if self.store.book.on_unheld == self.nudge:
            self.store.book.on_unheld = None
        if self.store.book.on_pushed == self.pushed:
            self.store.book.on_pushed = None
        self._aside.shutdown(wait=False, cancel_futures=True)
        self.client.close()
