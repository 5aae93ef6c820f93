"""Policy versions a peer holds and rebuilds, whatever the transport: the store of versions
(`VersionStore`: each one's weights and the payloads that serve it), what a fetch brought
(`FetchResult`), and `RebuildingClient`, which rebuilds fetched versions bit for bit, checking
every hash. Each transport serves the store and fetches payloads (hivemind/weights.py,
grpc/weights.py).

Only the run's learners may publish: a receiver is given the learners' public keys (the
`[owner:...]` bytes of their signing keys) and ignores announcements under any other key, so a
volunteer cannot push weights. A receiver that holds version k asks for k -> want and gets the
chain of deltas; a new or too-far-behind receiver gets a snapshot. Published versions need not be
consecutive: a learner whose publishing falls behind skips versions (publisher.py), and each delta
goes from the version published before it (`VersionStore.bases`; receivers read it from the
announcement's recent versions: sharer_view.delta_base).

A learner holds up to max_staleness + 1 versions for verification and serving, so not each one
whole: the newest is whole and each older one an undo delta from the one after it, rebuilt on
demand (`VersionStore.state`: one copy of the newest and a scatter of each undo delta's changes,
undo.py) with a small cache of the versions rebuilt last.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

import torch

from swarm.fabric.weights.chunks import (
    MAX_PEER_ID_CHARS,
    ChunkBook,
    ChunkSpec,
    Redirected,
    answer_limit,
    chunk_request,
)
from swarm.fabric.weights.delta import (
    MAX_PAYLOAD_BYTES,
    CorruptVersion,
    apply_payload_verified,
    encode_delta,
    encode_snapshot,
    non_finite_tensors,
    state_hash,
)
from swarm.fabric.weights.undo import UndoDelta, apply_chain, encode_undo
from swarm.fabric.weights.upload_slots import HolderBusy

logger = logging.getLogger(__name__)


# How many versions a peer keeps (a learner up to this many plus the current one, for verifying
# groups and deltas to samplers that far behind, all but the newest as undo deltas; a sampler
# simulating latency this many, or --lag-steps + 2, whole).
MAX_HELD_VERSIONS = 64


class OversizedPayload(CorruptVersion):
    """A holder announced a weight payload larger than MAX_PAYLOAD_BYTES."""


HEADER_LIMIT = 64 * 1024  # a weight transfer's header is a small map
WEIGHT_REQUEST_LIMIT = 64 * 1024  # {have, want}, a chunk request, or a pushed announcement (announcement_push)
SLOWEST_RECEIVER = 128 * 1024  # bytes/s: a receiver slower than this (for a whole payload) is cut off
SNAPSHOT_DEFER_S = 10.0  # the longest a learner holds back a new version's snapshot while its delta goes out


def send_deadline(size: int) -> float:
    """Seconds a receiver gets to take `size` bytes before a holder gives up on it (and frees the slot)."""
    return 30.0 + size / SLOWEST_RECEIVER


def check_payload_count(count, have: int | None, want: int, holder) -> int:
    """The number of payloads a holder may send for have -> want: the deltas have+1..want, or one
    snapshot. Checked before anything is read, so a holder cannot make a receiver buffer more."""
    most = want - have if have is not None and have < want else 1
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= most:
        raise CorruptVersion(f"holder {holder} announced {count!r} payloads for {have} -> {want} (1..{most})")
    return count


def payload_limit(state: Mapping[str, torch.Tensor] | None) -> int:
    """The largest weight payload a peer holding a model shaped like `state` accepts: every tensor
    at 4 bytes an element (float32, the widest dtype a version is published in) or its own width
    when wider, plus room for names and framing. None (the model's shapes are not known here, as
    in the vLLM backend): MAX_PAYLOAD_BYTES."""
    if state is None:
        return MAX_PAYLOAD_BYTES
    body = sum(t.numel() * max(t.element_size(), 4) + 512 + len(name) for name, t in state.items())
    return min(MAX_PAYLOAD_BYTES, body + (1 << 20))


def check_payload_size(size: int, holder, limit: int = MAX_PAYLOAD_BYTES) -> int:
    if not isinstance(size, int) or size < 0 or size > limit:
        raise OversizedPayload(f"holder {holder} announced a weight payload of {size} bytes (limit {limit})")
    return size


@dataclass
class FetchResult:
    """What one fetch brought: the verified version, from whom, and what it cost."""

    version: int
    holder: str
    bytes: int  # payload bytes received
    kinds: list[str]  # "snapshot" or "delta", per payload
    seconds: float
    relayed: bool = False  # from a peer other than the learner that announced it
    transfer_s: float = 0.0  # of `seconds`, until the payloads were all here (the rest: applying, verifying)
    sources: dict[str, int] = field(default_factory=dict)  # in chunks: bytes per peer that sent some

    def heartbeat_fields(self) -> dict:
        """The fields of a sampler's Heartbeat that report this fetch (a learner orders chains by them)."""
        return {"fetch_version": self.version, "fetch_from": self.holder, "fetch_bytes": self.bytes,
                "fetch_s": round(self.seconds, 4), "fetch_transfer_s": round(self.transfer_s, 4)}

    def event_fields(self) -> dict:
        """The fields of a `version_fetched` record in a peer's events.jsonl."""
        fields = {"version": self.version, "holder": self.holder, "bytes": self.bytes, "kinds": self.kinds,
                  "seconds": round(self.seconds, 4), "transfer_s": round(self.transfer_s, 4), "relayed": self.relayed}
        if self.sources:
            fields["sources"] = dict(self.sources)
        return fields


class HeldStates(Mapping):
    """version -> weights of every version a store holds, rebuilt on demand (VersionStore.state):
    `in`, iteration and len() read the held versions without rebuilding anything."""

    def __init__(self, store: "VersionStore") -> None:
        self._store = store

    def __getitem__(self, version: int) -> dict[str, torch.Tensor]:
        return self._store.state(version)

    def __contains__(self, version) -> bool:
        return version in self._store.hashes

    def __iter__(self) -> Iterator[int]:
        with self._store.lock:
            return iter(list(self._store.hashes))

    def __len__(self) -> int:
        return len(self._store.hashes)


class VersionStore:
    """The versions a peer holds: each one's hash, the delta that produced it (from the version held
    before it, `bases`) and its weights, held as few whole states plus the chain of deltas between
    them (`states` rebuilds any held version on demand). Thread-safe (`lock` guards what is held):
    a weight server reads it while the peer adds versions.

    capacity: the most versions held (the oldest go first). whole_states: how many of the newest
    versions are held whole (None: all of them, as a sampler that loads them does); each older one
    is held as an undo delta from the version after it (undo.py: never sent, so coded to apply
    fast rather than as a wire delta), encoded as it stops being whole, and is rebuilt from the
    nearest whole state by applying undo deltas, the result checked against the version's hash
    (`state`). At Qwen3-0.6B shape (1.2 GB a state) with ~4% of elements changing per version an undo
    delta is ~1.7% of a state: 65 versions held as one whole state and 64 undo deltas take about two
    states' worth instead of 65 (benchmarks/version_memory.py). cached_states: the most recently
    rebuilt versions kept whole beside them (an LRU: verification asks for a few recent versions
    over and over). delta_budget: how many snapshots' worth of forward deltas (those served) are
    kept, newest first: a receiver further behind than that gets a snapshot, which payloads() would
    send it anyway once the chain outweighs one (None: every held version's)."""

    def __init__(self, capacity: int = 8, *, whole_states: int | None = None, cached_states: int = 1,
                 delta_budget: float | None = None) -> None:
        if whole_states is not None and whole_states < 1:
            raise ValueError(f"whole_states must be at least 1 (the newest version is always held whole), not {whole_states}")
        self.capacity, self.whole_states, self.cached_states, self.delta_budget = capacity, whole_states, cached_states, delta_budget
        self.lock = threading.RLock()
        self.hashes: dict[int, str] = {}  # every held version, in ascending order
        self.deltas: dict[int, bytes] = {}  # version -> delta from bases[version] (the version held before it)
        self.bases: dict[int, int] = {}
        self.states = HeldStates(self)
        self._whole: dict[int, dict[str, torch.Tensor]] = {}
        self._undo: dict[int, UndoDelta] = {}  # version -> the changes that take the version after it back to it
        self._cache: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._rebuilding = threading.Lock()  # one rebuild at a time: each holds a whole state while it works
        self._state_bytes = 0  # a whole state's size (snapshot_bytes of the newest)
        self._snapshot: tuple[int, bytes] | None = None  # the last snapshot encoded: new peers ask for the same one
        self._added_at: dict[int, float] = {}  # version -> when it was added (time.monotonic)
        self.book = ChunkBook(self.payload)  # what this peer serves in chunks (and receives, while it does)

    @property
    def latest(self) -> int | None:
        with self.lock:
            return next(reversed(self.hashes)) if self.hashes else None

    def add(self, version: int, state: Mapping[str, torch.Tensor], delta: bytes | None = None, *,
            digest: str | None = None, snapshot: bytes | None = None, owned: bool = False, base: int | None = None,
            undo: Mapping[int, UndoDelta] | None = None) -> str:
        """Hold `state` as `version`, newer than any held (computing the delta from the newest held
        version when none is given). A receiver passes what it has verified already: the `delta` it
        applied and the version it applied it to (`base`; default version - 1), the `digest`, the
        `snapshot` payload it received (served on as is), and `owned=True` when nothing else refers
        to `state` (no copy is made). `undo`: undo deltas encoded elsewhere (a publisher's encoding
        process), by version; one is used only where this add demotes that version and it joins the
        same versions and hashes as the one encoded here would, and any other demoted version is
        encoded here. The encoding runs outside the lock: one thread adds."""
        if not owned:
            state = {k: v.detach().cpu().clone() for k, v in state.items()}
        digest = digest or state_hash(state)
        with self.lock:
            latest = self.latest
            if latest is not None and version <= latest:
                raise ValueError(f"version {version} is not newer than the newest held ({latest}); versions never go back")
            previous = self._whole.get(latest) if latest is not None else None
            whole = sorted(self._whole)
            known = {v: self.hashes[v] for v in whole if v in self.hashes}
        known[version] = digest
        if delta is None and previous is not None:  # (both hashes known: neither state is hashed again)
            delta, base = encode_delta(previous, state, base_version=latest, version=version, base_hash=known[latest],
                                       new_hash=digest), latest
        elif delta is not None and base is None:
            base = version - 1
        given, undo = undo or {}, {}
        if self.whole_states is not None:  # the whole states that stop being whole: each as an undo delta from the next
            kept = (whole + [version])[-self.whole_states:]
            ladder = whole + [version]
            for older, newer in zip(ladder, ladder[1:]):
                if older not in kept and older in self.hashes:
                    entry = given.get(older)
                    if entry is not None and (entry.version, entry.version_hash, entry.newer, entry.newer_hash) == (
                            older, known[older], newer, known[newer]):
                        undo[older] = entry
                        continue
                    newer_state = state if newer == version else self._whole[newer]
                    undo[older] = encode_undo(newer_state, self._whole[older], newer=newer, newer_hash=known[newer],
                                              version=older, version_hash=known[older])
        with self.lock:
            if snapshot is not None:
                self._snapshot = (version, snapshot)
            self._whole[version] = state
            self._state_bytes = snapshot_bytes(state)
            self.hashes[version] = digest
            self._added_at[version] = time.monotonic()
            if delta is not None:
                self.deltas[version], self.bases[version] = delta, base
            for older, entry in undo.items():
                self._undo[older] = entry
                del self._whole[older]
            self._evict()
            return digest

    def _evict(self) -> None:
        """Drops the oldest versions past `capacity` and forward deltas past `delta_budget` (under the lock)."""
        while len(self.hashes) > self.capacity:
            old = next(iter(self.hashes))
            for held in (self.hashes, self._added_at, self._whole, self._undo, self._cache, self.deltas, self.bases):
                held.pop(old, None)
        if self.delta_budget is not None:
            kept, budget = 0, self.delta_budget * self._state_bytes
            for v in sorted(self.deltas, reverse=True):
                kept += len(self.deltas[v])
                if kept > budget:
                    del self.deltas[v], self.bases[v]
        for v in [v for v in self.deltas if v not in self.hashes]:
            del self.deltas[v], self.bases[v]

    def held_bytes(self) -> dict[str, int]:
        """What the held versions take, in bytes: whole states, rebuilt ones cached, undo and forward deltas."""
        with self.lock:
            return {"whole": len(self._whole) * self._state_bytes, "cached": len(self._cache) * self._state_bytes,
                    "undo": sum(u.nbytes for u in self._undo.values()), "deltas": sum(map(len, self.deltas.values()))}

    def ready(self, version: int) -> bool:
        """Whether held `version` is whole or cached: `state` returns it without rebuilding."""
        with self.lock:
            return version in self._whole or version in self._cache

    def state(self, version: int) -> dict[str, torch.Tensor]:
        """The weights of held `version` (KeyError: not held): whole, cached, or rebuilt from the
        nearest newer whole (or cached) state through undo deltas (CorruptVersion should it not
        rebuild: a bug, never a peer's doing).

        The chain is applied to one copy of the base, each undo delta scattering its changes into
        it (undo.py: time in proportion to the changes, not the model), and only its end is
        hashed: the undo deltas were encoded here, from states whose hashes this store computed,
        so hashing every state on the way (as the wire codec's applies do, twice a step) would
        check nothing the end does not. Each step checks the delta's recorded pairing (it starts
        from the version and hash the last one ended at), which costs no pass over the weights; a
        corrupted undo delta anywhere in the chain makes the end's hash differ."""
        with self.lock:
            found = self._whole.get(version)
            if found is None and version in self._cache:
                self._cache.move_to_end(version)
                found = self._cache[version]
            if found is not None:
                return found
            if version not in self.hashes:
                raise KeyError(f"version {version} is not held here")
        with self._rebuilding:
            with self.lock:  # (another thread may have rebuilt it meanwhile)
                if version in self._cache:
                    return self._cache[version]
                chain, start = [], version
                while start not in self._whole and start not in self._cache:
                    if start not in self._undo:
                        raise KeyError(f"version {version} is held but cannot be rebuilt (no undo delta of {start})")
                    undo = self._undo[start]
                    if undo.newer <= start:  # (never: each is rebuilt from a newer version)
                        raise CorruptVersion(f"undo delta held for version {start} is from version {undo.newer}")
                    chain.append(undo)
                    start = undo.newer
                base = self._whole[start] if start in self._whole else self._cache[start]
                base_hash, want = self.hashes[start], self.hashes[version]
            state = apply_chain(base, base_hash, chain[::-1])
            if state_hash(state) != want:
                raise CorruptVersion(f"version {version} rebuilt through {len(chain)} undo deltas does not match its hash")
            with self.lock:
                if version in self.hashes and self.cached_states > 0:
                    self._cache[version] = state
                    while len(self._cache) > self.cached_states:
                        self._cache.popitem(last=False)
            return state

    def chain(self, have: int, want: int) -> list[bytes] | None:
        """The held deltas leading from `have` to `want`, oldest first; None when they do not."""
        with self.lock:
            chain, v = [], want
            while v > have and v in self.deltas:
                chain.append(self.deltas[v])
                v = self.bases[v]
            return chain[::-1] if v == have and chain else None

    def payloads(self, have: int | None, want: int) -> list[bytes]:
        """Deltas from have to want when all are held and together smaller than a snapshot of `want`
        (a long chain of dense deltas can outweigh the version itself), else that snapshot."""
        with self.lock:
            if want not in self.hashes:
                raise KeyError(f"version {want} is not held here")
            if have is not None and have < want:
                chain = self.chain(have, want)
                if chain is not None and sum(map(len, chain)) < self._state_bytes:
                    return chain
        return [self._snapshot_of(want)]

    def _snapshot_of(self, version: int) -> bytes:
        cached = self._snapshot
        if cached is not None and cached[0] == version:
            return cached[1]
        snapshot = encode_snapshot(self.state(version), version)
        self._snapshot = (version, snapshot)
        return snapshot

    def payload(self, kind: str, version: int) -> bytes | None:
        """The delta to `version` or its snapshot, as held here (None: not held). Snapshots only of
        the newest version or the one encoded last: any other would be encoded (and hashed) afresh
        for whoever asks, evicting the one that new peers need."""
        with self.lock:
            if kind == "delta":
                return self.deltas.get(version)
            cached = self._snapshot
            if version not in self.hashes or (version != self.latest and (cached is None or cached[0] != version)):
                return None
        return self._snapshot_of(version)

    def snapshot_due(self, version: int) -> bool:
        """Whether a learner should encode and hash the snapshot of `version` now (chunk_specs
        without `quick`): not once done, nor while the delta to it goes out for the first time,
        unless that takes SNAPSHOT_DEFER_S. Samplers one version behind, nearly all, wait for the delta, and encoding
        a whole model beside it held up the learner's part of it: with 8 samplers on 100 Mbit/s
        links, its first 16 chunks of a 9.7 MB delta went out at half the link's rate
        (benchmarks/fanout_wan.py). Once every chunk of the delta went to a relaying peer, the swarm
        passes it on without the learner."""
        if self.book.cached_spec("snapshot", version) is not None:
            return False
        with self.lock:
            if version not in self.deltas:
                return True
            added = self._added_at.get(version, 0.0)
        return self.book.sent_out("delta", version) or time.monotonic() - added >= SNAPSHOT_DEFER_S

    def chunk_specs(self, version: int, *, quick: bool = False) -> list[ChunkSpec]:
        """The chunk specs of the delta to `version` (when held) and of its snapshot: what a
        learner announces (hashed once per payload: ChunkBook caches them). `quick`: the delta's
        (hashing a delta is cheap) and the snapshot's only when already computed (encoding and
        hashing a whole model takes seconds for a real one: samplers one version behind, nearly
        all of them, need not wait for it)."""
        specs = [self.book.spec("delta", version)]
        specs.append(self.book.cached_spec("snapshot", version) if quick else self.book.spec("snapshot", version))
        return [spec for spec in specs if spec is not None]


def snapshot_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """About the size of a snapshot of `state` (encode_snapshot stores each tensor's raw bytes)."""
    return sum(t.numel() * t.element_size() for t in state.values())


def refuse_unless_ok(header: dict, holder, want: int) -> None:
    """Raise HolderBusy or KeyError when a holder's header says it will not send `want`."""
    if header.get("ok"):
        return
    if header.get("busy"):
        raise HolderBusy(f"holder {holder} is busy: {str(header.get('reason'))[:200]}")
    target = header.get("redirect")
    if isinstance(target, str) and 0 < len(target) <= MAX_PEER_ID_CHARS:
        raise Redirected(holder, target)
    raise KeyError(f"holder {holder} cannot serve version {want}: {str(header.get('reason'))[:200]}")


class RebuildingClient:
    """Fetches a version from a holder and rebuilds it against what this peer already holds;
    transports supply `_payloads(holder, have, want)`, each payload at most `max_payload_bytes`.
    `on_received(n)`, when set, hears of every piece of n bytes of a whole version as it arrives
    (from the transport's thread): a download's progress."""

    max_payload_bytes: int = MAX_PAYLOAD_BYTES
    on_received: Callable[[int], None] | None = None

    def _payloads(self, holder, have: int | None, want: int, timeout_s: float | None = None) -> list[bytes]:
        """The payloads have -> want from `holder`; `timeout_s`: a shorter limit on the whole
        answer than the client's own (a relay's attempt: follower.relay_deadline)."""
        raise NotImplementedError

    def _single(self, holder, request: dict, size: int, timeout: float,
                sink: Callable[[bytes], None] | None = None) -> bytes:
        """One answer of at most `size` bytes to `request` (a manifest or chunk request); `sink`
        hears its bytes as they arrive, in order (what it is given is exactly what is returned).
        Raises ChunkCutOff when the holder cut the answer off once it had begun."""
        raise NotImplementedError

    def piece(self, holder, spec: ChunkSpec, index: int | None, wait_s: float = 0.0, *, force: bool = False,
              relays: bool = False, sink: Callable[[bytes], None] | None = None, timeout_s: float | None = None) -> bytes:
        """The manifest (index None) or chunk `index` of `spec`'s payload from `holder`, of exactly
        the size it must have and not verified yet (the caller checks it against the spec).
        KeyError: not held there (Redirected: it sent the chunk to another peer, unless `force`);
        HolderBusy: no upload slot (ChunkCutOff: the holder passed the chunk on as it arrived there,
        and it did not arrive whole); CorruptVersion: a malformed answer. `relays`: this peer serves
        the chunk on, so the holder may send other requesters here; `sink`: hears the chunk's bytes
        as they arrive (Partial.receiving); `timeout_s`: a shorter limit on the whole answer than the
        one any holder gets (a source judged by its rate: chunked_fetch)."""
        size = answer_limit(spec, index)
        timeout = wait_s + send_deadline(size)
        data = self._single(holder, chunk_request(spec, index, wait_s, force=force, relays=relays), size,
                            timeout if timeout_s is None else min(timeout, timeout_s), sink)
        if len(data) != size:
            raise CorruptVersion(f"holder {holder} sent {len(data)} bytes where {size} were due")
        return data

    def fetch(self, holder, want: int, want_hash: str, store: VersionStore,
              known: Mapping[int, str] | None = None, timeout_s: float | None = None) -> FetchResult:
        """Version `want` from `holder`, added to `store`. Raises CorruptVersion (nothing is
        added) when what arrives does not rebuild `want_hash`. The versions a chain of deltas
        passes through are kept too, but only those whose hash `known` (the learner's signed
        hashes of recent versions) vouches for: a relay must not get a state of its making stored
        (and served on) under a version number. Deltas that do not apply (this peer's base is not
        what the holder thinks) are followed by one request for a snapshot, rather than the same
        deltas again at every poll; if that request fails too, the deltas' CorruptVersion is
        raised (a holder that sent bad data is blamed for it, however its retry ends). `timeout_s`:
        a shorter limit than the client's on each request to this holder."""
        try:
            return self._fetch(holder, want, want_hash, store, known or {}, deltas=True, timeout_s=timeout_s)
        except CorruptVersion as exc:
            if not getattr(exc, "from_deltas", False):
                raise
            logger.info("deltas to version %d from %s did not apply (%s); asking for a snapshot", want, holder, exc)
            try:
                return self._fetch(holder, want, want_hash, store, known or {}, deltas=False, timeout_s=timeout_s)
            except CorruptVersion:
                raise
            except Exception as later:  # noqa: BLE001  busy, gone, or hung up mid-answer: what this holder
                # did send did not verify, and that (not the failed retry) is what the caller must hear of
                raise exc from later

    def _fetch(self, holder, want: int, want_hash: str, store: VersionStore, known: Mapping[int, str], *,
               deltas: bool, timeout_s: float | None = None) -> FetchResult:
        started = time.time()
        with store.lock:
            have = store.latest if deltas and store.latest is not None and store.latest < want else None
        payloads = self._payloads(holder, have, want, timeout_s) if timeout_s is not None else self._payloads(holder, have, want)
        return self.rebuild(holder, have, payloads, want, want_hash, store, known, started)

    def rebuild(self, holder, have: int | None, payloads: list[bytes], want: int, want_hash: str, store: VersionStore,
                known: Mapping[int, str], started: float) -> FetchResult:
        """Apply `payloads` (have -> want) to what `store` holds, verify and keep the result
        (`fetch`; also for payloads assembled from chunks)."""
        transferred = time.time()
        base = store.state(have) if have is not None else None
        state, version = base, have
        built: list[tuple[int, dict, bytes, str, str]] = []
        digest = None
        for step, payload in enumerate(payloads):
            try:  # raises CorruptVersion on any mismatch
                version, state, digest, kind = apply_payload_verified(payload, state, max_bytes=self.max_payload_bytes)
            except CorruptVersion as exc:
                exc.from_deltas = have is not None
                raise
            # every version kept must be the one its number says: deltas to ascending versions after
            # `have` (a learner that skipped versions sends the delta across the gap), or one snapshot
            # of `want` (only the last hash is announced, so a holder must not get other states stored
            # under earlier numbers: intermediate ones are kept only where `known` vouches for them)
            previous = have if step == 0 else built[-1][0]
            if (not previous < version <= want) if kind == "delta" else (len(payloads) != 1 or version != want):
                raise CorruptVersion(f"holder {holder} sent {kind} {version} out of order (asked {have} -> {want})")
            built.append((version, state, payload, digest, kind))
        if version != want or digest != want_hash:
            raise CorruptVersion(f"holder {holder} sent version {version}, not {want} with the announced hash")
        bad = non_finite_tensors(state)
        if bad:  # signed and hashed, and still unusable: never load it
            raise CorruptVersion(f"version {want} from {holder} holds non-finite weights ({', '.join(bad[:3])})")
        applied_to = have
        for v, s, payload, d, kind in built:  # only a fully verified chain is kept, and of it what is vouched for
            if v == want or known.get(v) == d:
                store.add(v, s, delta=payload if kind == "delta" else None, digest=d, base=applied_to,
                          snapshot=payload if kind == "snapshot" else None, owned=True)
            applied_to = v
        return FetchResult(version=want, holder=str(holder), bytes=sum(len(p) for p in payloads),
                           kinds=[b[4] for b in built], seconds=time.time() - started, transfer_s=transferred - started)
