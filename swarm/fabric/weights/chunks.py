"""Versions in verifiable chunks, so that a peer can pass a version on while it still receives it.

A payload (the delta from version - 1, or a snapshot) is cut into chunks of `chunk_bytes`. Its
manifest is the chunks' sha256 digests, concatenated; its root, a sha256 over the payload's size,
the chunk size and the manifest, is carried in the learner's signed announcement (ChunkSpec.token).
A receiver checks a manifest against the root and each chunk against the manifest as it arrives,
so a chunk is as good as the learner's signature whoever sent it, and a peer serves every verified
chunk it holds before it holds the whole payload (cut-through). The assembled payload is then
applied and checked against the version's hash as before: a model never loads anything else.

A holder of a complete payload sends each chunk once per fan-out: a second requester of a chunk
within takers.REDIRECT_S of the first is sent to the first (`Takers`), which holds the chunk or is
receiving it, unless it asks again with `force` (that peer failed it). So peers whose views of who
fetches what differ still cost the learner about one copy, not one per view.

A holder answers from a complete payload it holds (its store's delta or snapshot of that version,
served only when its own manifest has the root asked for: an honest relay whose encoding differs
answers "not held" and earns no strike) or from a payload it is receiving (a `Partial`), waiting
a few seconds for a chunk that has not arrived yet.

Cut-through reaches inside a chunk: a chunk a relaying peer is receiving is passed on to the
peers asking for it as its bytes arrive (`ChunkFeed`), all but its last byte, which follows only
once the whole chunk matched its digest here. A chunk that does not arrive whole, or does not
verify, is cut off before that byte, so no peer ever holds a whole chunk its sender did not
verify (and each receiver checks it against the manifest all the same). Passed on only whole, a
chunk would reach the peers after its owner at the earliest one chunk's transfer later; the
owner's stripe arrives at its share of the learner's uplink while the other owners' forwards
fill its downlink (1/8 of it among 8 sharers: 0.34 s for 256 KiB at 50 Mbit/s), so every peer lagged
the learner by that much.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from swarm.fabric.weights.delta import MAX_PAYLOAD_BYTES, CorruptVersion
from swarm.fabric.weights.takers import Takers
from swarm.fabric.weights.upload_slots import HolderBusy

KINDS = ("delta", "snapshot")
DIGEST_BYTES = 32  # sha256
DEFAULT_CHUNK_BYTES = 1 << 20  # 84 ms at 100 Mbit/s: a pipeline's cost per hop (the largest chunk)
# a smaller payload is cut into at least this many chunks, of at least MIN_AUTO_CHUNK_BYTES: a
# striped fan-out to n peers ends (n - 1) chunks after the learner's last send (its owner passes it
# on to each of the others), so 10 chunks of a 10 MB delta among 8 samplers cost 0.7 of a transfer
# time on top, 38 cost 0.2 (measured: benchmarks/fanout_wan.py)
TARGET_CHUNKS = 32
MIN_AUTO_CHUNK_BYTES = 1 << 16  # a chunk's request and stream cost more than its bytes below this
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 1 << 12, 1 << 22  # what a receiver accepts (4 MiB: gRPC's message bound)
MAX_CHUNKS = 1 << 16  # a manifest of at most 2 MiB
MAX_WAIT_S = 10.0  # longest a holder holds a request for a chunk it does not have yet
# requests waiting at once for chunks on their way; beyond that a missing chunk is answered busy at
# once (ask again shortly: NotYetHere), never "not held", which a fetch counts against the holder.
# Sized for a stripe owner asked by 8 sharers' 4 workers each (chunked_fetch.SHARED_WORKERS) at a
# fetch's start
MAX_WAITERS = 32
MAX_PEER_ID_CHARS = 128  # as membership records bound them
# a chunk arriving here is read (and passed on) in PIECES_PER_CHUNK pieces, each at least
# FORWARD_PIECE_BYTES: enough of them that the next peer gets the first while the rest arrive (a 1 MiB
# chunk's pieces of 128 KiB follow each other within 10 ms at 100 Mbit/s), and an owner's pace is
# timed between them (owner_pace.PieceTiming); few enough that each costs little CPU. With 32 KiB
# pieces for every chunk, 8 samplers on this machine's 2 cores took 3.30-3.34 s for the fan-out's
# 19.7 MB delta (6.3 CPU seconds while it went out); with 128 KiB, 3.07 s (5.7): benchmarks/fanout_wan
FORWARD_PIECE_BYTES = 1 << 15
PIECES_PER_CHUNK = 8


def forward_piece_bytes(chunk_bytes: int) -> int:
    """The size of the pieces a chunk of `chunk_bytes` is read and passed on in."""
    return max(FORWARD_PIECE_BYTES, chunk_bytes // PIECES_PER_CHUNK)
_TOKEN = re.compile(r"^(delta|snapshot):([0-9]{1,13}):([0-9]{1,13}):([0-9]{1,8}):([0-9a-f]{64})$")
TOKEN_PATTERN = _TOKEN.pattern


@dataclass(frozen=True)
class ChunkSpec:
    """A payload as its publisher chunked it: kind, version, size, chunk size and manifest root."""

    kind: str
    version: int
    size: int
    chunk_bytes: int
    root: str

    @property
    def count(self) -> int:
        return -(-self.size // self.chunk_bytes)

    def bounds(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_bytes
        return start, min(self.size, start + self.chunk_bytes)

    @property
    def token(self) -> str:
        """The spec as one string of an announcement ("KIND:VERSION:SIZE:CHUNK:ROOT")."""
        return f"{self.kind}:{self.version}:{self.size}:{self.chunk_bytes}:{self.root}"

    @classmethod
    def parse(cls, token: str, max_bytes: int = MAX_PAYLOAD_BYTES) -> "ChunkSpec":
        """A spec from its token; ValueError when it is malformed or out of bounds."""
        match = _TOKEN.match(token) if isinstance(token, str) else None
        if match is None:
            raise ValueError(f"malformed chunk spec {str(token)[:100]!r}")
        kind, version, size, chunk, root = match.groups()
        spec = cls(kind, int(version), int(size), int(chunk), root)
        if not (1 <= spec.size <= max_bytes and MIN_CHUNK_BYTES <= spec.chunk_bytes <= MAX_CHUNK_BYTES
                and spec.count <= MAX_CHUNKS):
            raise ValueError(f"chunk spec out of bounds: {spec.size} bytes in chunks of {spec.chunk_bytes}")
        return spec

    def digests(self, manifest: bytes, holder) -> list[bytes]:
        """The chunk digests of a manifest a holder sent, once it is checked against the root."""
        if not isinstance(manifest, bytes) or len(manifest) != self.count * DIGEST_BYTES or \
                root_of(self.size, self.chunk_bytes, manifest) != self.root:
            raise CorruptVersion(f"holder {holder} sent a manifest of {self.kind} {self.version} that does not match "
                                 "the announced root")
        return [manifest[i:i + DIGEST_BYTES] for i in range(0, len(manifest), DIGEST_BYTES)]


def root_of(size: int, chunk_bytes: int, manifest: bytes) -> str:
    head = b"gepo-swarm chunks v1\0" + size.to_bytes(8, "little") + chunk_bytes.to_bytes(4, "little")
    return hashlib.sha256(head + manifest).hexdigest()


def manifest_of(payload: bytes, chunk_bytes: int) -> bytes:
    view = memoryview(payload)
    return b"".join(hashlib.sha256(view[s:s + chunk_bytes]).digest() for s in range(0, len(payload), chunk_bytes))


def chunk_bytes_for(size: int, largest: int = DEFAULT_CHUNK_BYTES) -> int:
    """The chunk size for a payload of `size` bytes: the largest power of two that cuts it into at
    least TARGET_CHUNKS chunks, within MIN_AUTO_CHUNK_BYTES..`largest` (`largest` when that is below
    the floor). Every holder derives it alike, so a relay's manifest matches the learner's root."""
    fitting = 1 << max(0, (size // TARGET_CHUNKS).bit_length() - 1)
    return min(largest, max(MIN_AUTO_CHUNK_BYTES, fitting))


def spec_of(kind: str, version: int, payload: bytes, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[ChunkSpec, bytes]:
    """(spec, manifest) of a payload."""
    manifest = manifest_of(payload, chunk_bytes)
    return ChunkSpec(kind, version, len(payload), chunk_bytes, root_of(len(payload), chunk_bytes, manifest)), manifest


class Partial:
    """A payload being received: its verified chunks, which the weight server reads meanwhile."""

    def __init__(self, spec: ChunkSpec, manifest: bytes, digests: list[bytes]) -> None:
        self.spec, self.manifest, self.digests = spec, manifest, digests
        self.buffer = bytearray(spec.size)
        self.have = [False] * spec.count
        self.missing = spec.count
        self.closed = False
        # hears of each chunk another peer asks for while it is missing here: the fetch filling this
        # payload then fetches it next (peers whose views of who fetches what differ would otherwise
        # each wait for the other to have it)
        self.wanted: Callable[[int], None] | None = None
        self._cond = threading.Condition()
        self._inbound: dict[int, bytearray] = {}  # chunks arriving now: their bytes so far, not verified

    def receiving(self, index: int) -> Callable[[bytes], None] | None:
        """Start passing chunk `index` on while it arrives: the sink its bytes go to, in order
        (call `received(index)` when the attempt ends, whether the chunk was kept or not); None when
        the chunk is here, or arrives through another request already (that one is passed on)."""
        with self._cond:
            if self.have[index] or index in self._inbound or self.closed:
                return None
            arriving = self._inbound[index] = bytearray()
            self._cond.notify_all()  # requests waiting for the chunk start on its bytes

        def sink(piece: bytes) -> None:
            with self._cond:
                if self._inbound.get(index) is arriving:
                    arriving.extend(piece)
                    self._cond.notify_all()
        return sink

    def received(self, index: int) -> None:
        """The request bringing chunk `index` ended: the peers it was passed on to get the rest of
        the verified chunk, or are cut off when it was not kept."""
        with self._cond:
            self._inbound.pop(index, None)
            self._cond.notify_all()

    def put(self, index: int, data: bytes) -> bool:
        """Keep chunk `index` if it is the one the manifest names; False (nothing kept) otherwise."""
        start, end = self.spec.bounds(index)
        if len(data) != end - start or hashlib.sha256(data).digest() != self.digests[index]:
            return False
        with self._cond:
            if not self.have[index]:
                self.buffer[start:end] = data
                self.have[index] = True
                self.missing -= 1
                self._cond.notify_all()
        return True

    def feed(self, index: int, wait_s: float = 0.0) -> "bytes | ChunkFeed | None":
        """Chunk `index` once it is here, or its bytes as they arrive once it is on its way
        (a ChunkFeed), waiting up to `wait_s` for either; else None."""
        deadline = time.monotonic() + wait_s
        if wait_s > 0 and not self.have[index] and index not in self._inbound and self.wanted is not None:
            self.wanted(index)
        with self._cond:
            while not self.have[index]:
                arriving = self._inbound.get(index)
                if arriving is not None:
                    return ChunkFeed(self, index, arriving)
                left = deadline - time.monotonic()
                if self.closed or left <= 0:
                    return None
                self._cond.wait(left)
            start, end = self.spec.bounds(index)
            return bytes(self.buffer[start:end])

    @property
    def complete(self) -> bool:
        return self.missing == 0

    def payload(self) -> bytes:
        if not self.complete:
            raise RuntimeError(f"{self.missing} of {self.spec.count} chunks are still missing")
        return bytes(self.buffer)

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class ChunkCutOff(HolderBusy):
    """A chunk passed on while it arrived did not arrive whole or verified: its requester is cut
    off before the last byte, and asks again (as of a busy holder: no blame)."""


class ChunkFeed:
    """Chunk `index` of a Partial passed on while it arrives (Partial.feed): `next` gives its
    bytes in order, the last one only once the whole chunk verified. len(): the chunk's size."""

    def __init__(self, partial: Partial, index: int, arriving: bytearray) -> None:
        self.partial, self.index, self._arriving = partial, index, arriving
        start, end = partial.spec.bounds(index)
        self._start, self._size, self._sent = start, end - start, 0

    def __len__(self) -> int:
        return self._size

    def next(self, timeout: float) -> bytes | None:
        """The chunk's next bytes (waiting up to `timeout` for them); None once all were given.
        Raises ChunkCutOff when the chunk failed to arrive here, or its bytes stopped coming."""
        partial = self.partial
        deadline = time.monotonic() + timeout
        with partial._cond:
            while True:
                if self._sent >= self._size:
                    return None
                kept = partial.buffer
                if partial.have[self.index] and kept[self._start:self._start + self._sent] == self._arriving[:self._sent]:
                    # verified: the rest from the kept chunk, the last byte too (what was given matches
                    # it: another request, not this one's, may have brought the chunk that was kept)
                    piece = bytes(kept[self._start + self._sent:self._start + self._size])
                    self._sent = self._size
                    return piece
                if partial.have[self.index] or partial._inbound.get(self.index) is not self._arriving or partial.closed:
                    raise ChunkCutOff(f"chunk {self.index} of {partial.spec.kind} {partial.spec.version} did not "
                                      "arrive here whole and verified")
                ready = min(len(self._arriving), self._size - 1)  # the last byte waits for the digest
                if ready > self._sent:
                    piece = bytes(self._arriving[self._sent:ready])
                    self._sent = ready
                    return piece
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ChunkCutOff(f"chunk {self.index} of {partial.spec.kind} {partial.spec.version} stopped "
                                      f"arriving here for {timeout:.0f}s")
                partial._cond.wait(left)


class NotYetHere(Exception):
    """A chunk of a payload this peer is receiving that has not arrived within the request's wait
    (or that it cannot wait for now: too many requests wait already). The requester should ask
    again shortly rather than count it as a chunk the holder lacks: an owner that is slow to get
    its stripe is still the cheapest source of it."""


class ChunkBook:
    """What this peer can serve in chunks: complete payloads (`payload_of(kind, version)`, its
    store's bytes, or None) and the payloads it is receiving (`begin` .. `end`). `chunk_bytes`:
    the largest chunk it cuts a payload into (chunk_bytes_for)."""

    def __init__(self, payload_of: Callable[[str, int], bytes | None], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self._payload_of, self.chunk_bytes = payload_of, chunk_bytes
        # (kind, version) -> (spec, manifest, the payload it was computed from): a payload encoded
        # afresh is hashed afresh; few entries, as each keeps its payload alive
        self._manifests: OrderedDict[tuple[str, int], tuple[ChunkSpec, bytes, bytes]] = OrderedDict()
        self._partials: dict[tuple[str, int], Partial] = {}
        self._cond = threading.Condition()
        self._waiters = 0
        self.takers = Takers()
        # hears (kind, version) of each request for a payload neither held nor being received here:
        # a peer that started fetching a version asks this one for its stripe, which tells a follower
        # that has not looked at the announcements since that a version is out (VersionFollower.nudge)
        self.on_unheld: Callable[[str, int], None] | None = None
        # takes each announcement a learner pushes here (announcement_push): True when it verified
        self.on_pushed: Callable[[dict], bool] | None = None

    def spec(self, kind: str, version: int) -> ChunkSpec | None:
        """The spec of a complete payload held here (what a learner announces), or None."""
        found = self._complete(kind, version, None)
        return found[0] if found else None

    def cached_spec(self, kind: str, version: int) -> ChunkSpec | None:
        """The spec of a payload whose manifest was computed already (None: not yet)."""
        with self._cond:
            found = self._manifests.get((kind, version))
        return found[0] if found else None

    def _complete(self, kind: str, version: int, root: str | None) -> tuple[ChunkSpec, bytes, bytes] | None:
        payload = self._payload_of(kind, version)
        if payload is None:
            return None
        key = (kind, version)
        with self._cond:
            found = self._manifests.get(key)
        if found is None or found[2] is not payload:
            spec, manifest = spec_of(kind, version, payload, chunk_bytes_for(len(payload), self.chunk_bytes))
            found = (spec, manifest, payload)
            with self._cond:
                self._manifests[key] = found
                self._manifests.move_to_end(key)
                while len(self._manifests) > 3:
                    self._manifests.popitem(last=False)
        return found if root is None or found[0].root == root else None

    def sent_out(self, kind: str, version: int) -> bool:
        """Whether every chunk of the complete payload held here went to a relaying peer at least
        once: the swarm can then pass it all on without this peer."""
        spec = self.cached_spec(kind, version)
        return spec is not None and self.takers.taken((kind, version, spec.root)) >= spec.count

    def holds_whole(self, kind: str, version: int, root: str) -> bool:
        """Whether the complete payload with `root` is held here (not one being received)."""
        return self._complete(kind, version, root) is not None

    def begin(self, spec: ChunkSpec, manifest: bytes, digests: list[bytes],
              wanted: Callable[[int], None] | None = None) -> Partial:
        """A payload being received, served from now on (`wanted`: Partial.wanted)."""
        partial = Partial(spec, manifest, digests)
        partial.wanted = wanted
        with self._cond:
            old = self._partials.get((spec.kind, spec.version))
            if old is not None:
                old.close()
            self._partials[(spec.kind, spec.version)] = partial
            self._cond.notify_all()
        return partial

    def end(self, partial: Partial) -> None:
        """Stop serving from `partial` (call it after a complete payload went into the store)."""
        with self._cond:
            if self._partials.get((partial.spec.kind, partial.spec.version)) is partial:
                del self._partials[(partial.spec.kind, partial.spec.version)]
        partial.close()

    def lookup(self, kind: str, version: int, root: str, index: int | None, wait_s: float) -> "bytes | ChunkFeed | None":
        """The manifest (index None) or chunk `index` of the payload with `root`, from a complete
        payload or a partial one (a ChunkFeed: a chunk on its way, passed on as it arrives); waiting
        up to `wait_s` (at most MAX_WAIT_S) for it to arrive or start arriving.
        None: not held. Raises NotYetHere for a chunk of a payload being received here that did not
        arrive in time (at once when MAX_WAITERS requests wait already)."""
        with self._cond:
            crowded = self._waiters >= MAX_WAITERS
            if crowded:
                wait_s = 0.0
            self._waiters += 1
        deadline = time.monotonic() + min(max(wait_s, 0.0), MAX_WAIT_S)
        told = False
        try:
            while True:
                found = self._complete(kind, version, root)
                if found is not None:
                    spec, manifest, payload = found
                    if index is None:
                        return manifest
                    if index >= spec.count:
                        return None
                    start, end = spec.bounds(index)
                    return payload[start:end]
                with self._cond:
                    partial = self._partials.get((kind, version))
                    if partial is None or partial.spec.root != root:
                        if not told and partial is None and self.on_unheld is not None:
                            told = True
                            self.on_unheld(kind, version)
                        left = deadline - time.monotonic()
                        if left <= 0:
                            return None
                        self._cond.wait(min(left, 0.5))  # woken by `begin`; the store is looked at again
                        continue
                if index is None:
                    return partial.manifest
                if index >= partial.spec.count:
                    return None
                data = partial.feed(index, max(0.0, deadline - time.monotonic()))
                if data is None and not partial.closed:
                    raise NotYetHere(f"{MAX_WAITERS} requests wait for chunks here" if crowded
                                     else f"chunk {index} of {kind} {version} is on its way here")
                return data
        finally:
            with self._cond:
                self._waiters -= 1


def parse_chunk_request(request: dict) -> tuple[str, int, str, int | None, float]:
    """(kind, version, root, index or None for the manifest, wait seconds) of a request
    {op: "manifest" | "chunk", kind, version, root, index, wait, force, relays}; ValueError naming
    what is wrong. `force`: send it even if another peer took it (that peer failed the requester);
    `relays`: the requester serves what it receives to others (it may be sent their way)."""
    op, kind, version, root = request.get("op"), request.get("kind"), request.get("version"), request.get("root")
    index, wait = request.get("index"), request.get("wait", 0.0)
    if op not in ("manifest", "chunk") or kind not in KINDS:
        raise ValueError(f"unknown chunk request {op!r} for {kind!r}")
    if not _natural(version) or not isinstance(root, str) or not re.fullmatch(r"[0-9a-f]{64}", root):
        raise ValueError("a chunk request names a version (int >= 0) and a root (64 hex digits)")
    if op == "chunk" and not (_natural(index) and index < MAX_CHUNKS):
        raise ValueError(f"chunk index must be an int in 0..{MAX_CHUNKS - 1}")
    if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not 0 <= wait <= 3600:
        raise ValueError("wait must be a number of seconds")
    if not all(isinstance(request.get(flag, False), bool) for flag in ("force", "relays")):
        raise ValueError("force and relays must be true or false")
    return kind, version, root, index if op == "chunk" else None, float(wait)


def _natural(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


SLOT_WAIT_S = 2.0  # how long a chunk request queues for an upload slot before it is answered busy


def takes_slot(request: dict) -> bool:
    """Whether answering `request` (a valid manifest or chunk request) takes an upload slot: a chunk
    does; a manifest (32 bytes per chunk) does not, or a fetch's start would queue behind chunks."""
    return request.get("op") == "chunk"


def slot_share(size: int) -> float:
    """The share of an upload slot that sending a chunk of `size` bytes holds (UploadSlots): a
    DEFAULT_CHUNK_BYTES chunk a whole slot, a smaller one in proportion."""
    return min(1.0, max(size, 1) / DEFAULT_CHUNK_BYTES)


def redirect_reply(target: str) -> dict:
    return {"ok": False, "redirect": target, "reason": f"sent to {target} already: ask it", "count": 0}


def claim_chunk(book: ChunkBook, request: dict, taker: str, *, take: bool = True) -> dict | None:
    """Once an upload slot is taken for a valid chunk request: None to send the chunk (`taker`, the
    requester's peer id, is then its taker when it relays), or the redirect reply to send instead
    (the caller frees the slot). Only a complete payload's chunks are redirected. `take=False`
    only looks (before queueing for a slot): nothing is recorded."""
    kind, version, root, index = request["kind"], request["version"], request["root"], request["index"]
    if not book.holds_whole(kind, version, root):
        return None
    spec = book.cached_spec(kind, version)
    target = book.takers.claim((kind, version, root), index, taker, relays=take and request.get("relays", False),
                               force=request.get("force", False), count=spec.count if spec is not None else 0)
    return None if target is None else redirect_reply(target)


def chunk_answer(book: ChunkBook, request: dict, slots=None, who: str = "", taker: str = "") -> tuple[dict, bytes | None]:
    """A holder's answer to a manifest or chunk request: (header, data). With `slots`, when data
    is not None and the request `takes_slot`, its `slot_share` of an upload slot is held, which the
    caller releases (for `who`) once it has sent the data, and the chunk is claimed (`claim_chunk`: a redirect instead; without
    slots, the caller takes one and claims); `who` is the requester, whose turn for a slot comes by
    how many it was given (UploadSlots), `taker` its peer id (where later requesters of the chunk
    may be sent). Blocks (a chunk on its way, a slot): call it from a thread."""
    try:
        kind, version, root, index, wait = parse_chunk_request(request)
    except ValueError as exc:
        return {"ok": False, "reason": str(exc)[:200], "count": 0}, None
    if index is not None and (redirect := claim_chunk(book, request, taker, take=False)) is not None:
        return redirect, None  # before queueing for a slot
    try:
        data = book.lookup(kind, version, root, index, wait)
    except NotYetHere as exc:
        return {"ok": False, "busy": True, "not_yet": True, "reason": f"busy: {exc}", "count": 0}, None
    if data is None:
        what = "the manifest" if index is None else f"chunk {index}"
        return {"ok": False, "reason": f"{what} of {kind} {version} is not held here", "count": 0}, None
    if slots is not None and takes_slot(request):
        if not slots.take(SLOT_WAIT_S, who, slot_share(len(data))):
            return slots.busy_reply(), None
        redirect = claim_chunk(book, request, taker)
        if redirect is not None:
            slots.release(slot_share(len(data)), who)
            return redirect, None
    return {"ok": True, "count": 1, "sizes": [len(data)]}, data


def chunk_request(spec: ChunkSpec, index: int | None, wait_s: float, *, force: bool = False,
                  relays: bool = False) -> dict:
    """The request for a payload's manifest (index None) or one of its chunks (`force`, `relays`:
    parse_chunk_request)."""
    request = {"op": "manifest" if index is None else "chunk", "kind": spec.kind, "version": spec.version,
               "root": spec.root, "wait": float(wait_s)}
    if index is not None:
        request["index"] = index
        if force:
            request["force"] = True
        if relays:
            request["relays"] = True
    return request


def answer_limit(spec: ChunkSpec, index: int | None) -> int:
    """The exact size of the answer to `chunk_request(spec, index, ...)`."""
    if index is None:
        return spec.count * DIGEST_BYTES
    start, end = spec.bounds(index)
    return end - start
