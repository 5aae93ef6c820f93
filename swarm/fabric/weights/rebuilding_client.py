"""`RebuildingClient`: what a peer fetching a version runs, whatever the transport. It asks a holder
for the payloads from what this peer holds to the version it wants (or for a manifest and chunks:
`piece`), rebuilds the version bit for bit against its store, checks every hash on the way, and
keeps only versions whose hashes the learner vouched for. Transports supply the requests
(hivemind/weights.py, grpc/weights.py)."""

from __future__ import annotations

import logging
import time
from typing import Callable, Mapping

from swarm.fabric.weights.chunks import MAX_PEER_ID_CHARS, ChunkSpec, answer_limit, chunk_request
from swarm.fabric.weights.takers import Redirected
from swarm.fabric.weights.delta import MAX_PAYLOAD_BYTES, CorruptVersion, apply_payload_verified, non_finite_tensors
from swarm.fabric.weights.upload_slots import HolderBusy, NotHeldYet
from swarm.fabric.weights.versions import FetchResult, VersionStore, send_deadline

logger = logging.getLogger(__name__)

def refuse_unless_ok(header: dict, holder, want: int) -> None:
    """Raise HolderBusy or KeyError when a holder's header says it will not send `want`."""
    if header.get("ok"):
        return
    if header.get("busy"):
        raise (NotHeldYet if header.get("not_yet") else HolderBusy)(f"holder {holder} is busy: {str(header.get('reason'))[:200]}")
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
        # its hash as the store verified it: the delta's base check compares that instead of hashing
        # the whole base again (a quarter of an apply at Qwen3-0.6B shape). A base changed since
        # would still be caught: the result's hash would not match
        with store.lock:
            base_hash = store.hashes.get(have) if have is not None else None
        state, version = base, have
        built: list[tuple[int, dict, bytes, str, str]] = []
        digest = None
        for step, payload in enumerate(payloads):
            try:  # raises CorruptVersion on any mismatch
                version, state, digest, kind = apply_payload_verified(payload, state, max_bytes=self.max_payload_bytes,
                                                                      base_hash=base_hash)
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
            base_hash = digest  # (verified: the next delta's base)
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
