"""Policy versions a peer holds and rebuilds, whatever the transport: the store of versions
(`VersionStore`: each one's weights and the payloads that serve it), what a fetch brought
(`FetchResult`), and `RebuildingClient`, which rebuilds fetched versions bit for bit, checking
every hash. Each transport serves the store and fetches payloads (hivemind/weights.py,
grpc/weights.py).

Only the run's learners may publish: a receiver is given the learners' public keys (the
`[owner:...]` bytes of their signing keys) and ignores announcements under any other key, so a
volunteer cannot push weights. A receiver that holds version k asks for k -> want and gets the
chain of deltas; a new or too-far-behind receiver gets a snapshot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Mapping

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
from swarm.fabric.weights.upload_slots import HolderBusy

logger = logging.getLogger(__name__)


# How many versions a peer keeps in memory (a learner up to this many plus the current one, for
# deltas to samplers that far behind; a sampler simulating latency this many, or --lag-steps + 2).
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


class VersionStore:
    """The versions a peer holds: each one's weights and the delta that produced it. Thread-safe
    (`lock` guards `states`): a weight server reads it while the peer adds versions."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self.lock = threading.RLock()
        self.states: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self.deltas: dict[int, bytes] = {}  # version -> delta from version - 1
        self.hashes: dict[int, str] = {}
        self._snapshot: tuple[int, bytes] | None = None  # the last snapshot encoded: new peers ask for the same one
        self._added_at: dict[int, float] = {}  # version -> when it was added (time.monotonic)
        self.book = ChunkBook(self.payload)  # what this peer serves in chunks (and receives, while it does)

    @property
    def latest(self) -> int | None:
        with self.lock:
            return next(reversed(self.states)) if self.states else None

    def add(self, version: int, state: Mapping[str, torch.Tensor], delta: bytes | None = None, *,
            digest: str | None = None, snapshot: bytes | None = None, owned: bool = False) -> str:
        """Hold `state` as `version` (computing the delta from version - 1 when held). A receiver
        passes what it has verified already: the `digest`, the `snapshot` payload it received (served
        on as is), and `owned=True` when nothing else refers to `state` (no copy is made)."""
        if not owned:
            state = {k: v.detach().cpu().clone() for k, v in state.items()}
        digest = digest or state_hash(state)
        with self.lock:
            if snapshot is not None:
                self._snapshot = (version, snapshot)
            if delta is None and (version - 1) in self.states:
                delta = encode_delta(self.states[version - 1], state, base_version=version - 1, version=version)
            self.states[version] = state
            self.hashes[version] = digest
            self._added_at[version] = time.monotonic()
            if delta is not None:
                self.deltas[version] = delta
            while len(self.states) > self.capacity:
                old, _ = self.states.popitem(last=False)
                self.hashes.pop(old, None)
                self._added_at.pop(old, None)
            for v in [v for v in self.deltas if v not in self.states]:
                del self.deltas[v]
            return digest

    def payloads(self, have: int | None, want: int) -> list[bytes]:
        """Deltas have+1..want when all are held and together smaller than a snapshot of `want`
        (a long chain of dense deltas can outweigh the version itself), else that snapshot."""
        with self.lock:
            if want not in self.states:
                raise KeyError(f"version {want} is not held here")
            state = self.states[want]
            if have is not None and have < want and all(v in self.deltas for v in range(have + 1, want + 1)):
                chain = [self.deltas[v] for v in range(have + 1, want + 1)]
                if sum(map(len, chain)) < snapshot_bytes(state):
                    return chain
        return [self._snapshot_of(want, state)]

    def _snapshot_of(self, version: int, state: Mapping[str, torch.Tensor]) -> bytes:
        cached = self._snapshot
        if cached is not None and cached[0] == version:
            return cached[1]
        snapshot = encode_snapshot(state, version)
        self._snapshot = (version, snapshot)
        return snapshot

    def payload(self, kind: str, version: int) -> bytes | None:
        """The delta to `version` or its snapshot, as held here (None: not held). Snapshots only of
        the newest version or the one encoded last: any other would be encoded (and hashed) afresh
        for whoever asks, evicting the one that new peers need."""
        with self.lock:
            if kind == "delta":
                return self.deltas.get(version)
            state = self.states.get(version)
            cached = self._snapshot
            if state is None or (version != self.latest and (cached is None or cached[0] != version)):
                return None
        return self._snapshot_of(version, state)

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

    def _payloads(self, holder, have: int | None, want: int) -> list[bytes]:
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
              known: Mapping[int, str] | None = None) -> FetchResult:
        """Version `want` from `holder`, added to `store`. Raises CorruptVersion (nothing is
        added) when what arrives does not rebuild `want_hash`. The versions a chain of deltas
        passes through are kept too, but only those whose hash `known` (the learner's signed
        hashes of recent versions) vouches for: a relay must not get a state of its making stored
        (and served on) under a version number. Deltas that do not apply (this peer's base is not
        what the holder thinks) are followed by one request for a snapshot, rather than the same
        deltas again at every poll; if that request fails too, the deltas' CorruptVersion is
        raised (a holder that sent bad data is blamed for it, however its retry ends)."""
        try:
            return self._fetch(holder, want, want_hash, store, known or {}, deltas=True)
        except CorruptVersion as exc:
            if not getattr(exc, "from_deltas", False):
                raise
            logger.info("deltas to version %d from %s did not apply (%s); asking for a snapshot", want, holder, exc)
            try:
                return self._fetch(holder, want, want_hash, store, known or {}, deltas=False)
            except CorruptVersion:
                raise
            except Exception as later:  # noqa: BLE001  busy, gone, or hung up mid-answer: what this holder
                # did send did not verify, and that (not the failed retry) is what the caller must hear of
                raise exc from later

    def _fetch(self, holder, want: int, want_hash: str, store: VersionStore, known: Mapping[int, str], *,
               deltas: bool) -> FetchResult:
        started = time.time()
        with store.lock:
            have = store.latest if deltas and store.latest is not None and store.latest < want else None
        return self.rebuild(holder, have, self._payloads(holder, have, want), want, want_hash, store, known, started)

    def rebuild(self, holder, have: int | None, payloads: list[bytes], want: int, want_hash: str, store: VersionStore,
                known: Mapping[int, str], started: float) -> FetchResult:
        """Apply `payloads` (have -> want) to what `store` holds, verify and keep the result
        (`fetch`; also for payloads assembled from chunks)."""
        transferred = time.time()
        with store.lock:
            base = store.states[have] if have is not None else None
        state, version = base, have
        built: list[tuple[int, dict, bytes, str, str]] = []
        digest = None
        for step, payload in enumerate(payloads):
            try:  # raises CorruptVersion on any mismatch
                version, state, digest, kind = apply_payload_verified(payload, state, max_bytes=self.max_payload_bytes)
            except CorruptVersion as exc:
                exc.from_deltas = have is not None
                raise
            # every version kept must be the one its number says: deltas have+1, have+2, ... in
            # order, or one snapshot of `want` (only the last hash is announced, so a holder must
            # not get other states stored under earlier numbers)
            if (version != have + 1 + step) if kind == "delta" else (len(payloads) != 1 or version != want):
                raise CorruptVersion(f"holder {holder} sent {kind} {version} out of order (asked {have} -> {want})")
            built.append((version, state, payload, digest, kind))
        if version != want or digest != want_hash:
            raise CorruptVersion(f"holder {holder} sent version {version}, not {want} with the announced hash")
        bad = non_finite_tensors(state)
        if bad:  # signed and hashed, and still unusable: never load it
            raise CorruptVersion(f"version {want} from {holder} holds non-finite weights ({', '.join(bad[:3])})")
        for v, s, payload, d, kind in built:  # only a fully verified chain is kept, and of it what is vouched for
            if v == want or known.get(v) == d:
                store.add(v, s, delta=payload if kind == "delta" else None, digest=d,
                          snapshot=payload if kind == "snapshot" else None, owned=True)
        return FetchResult(version=want, holder=str(holder), bytes=sum(len(p) for p in payloads),
                           kinds=[b[4] for b in built], seconds=time.time() - started, transfer_s=transferred - started)
