"""Policy versions a peer holds and rebuilds, whatever the transport: the store of versions
(`VersionStore`: each one's weights and the payloads that serve it), what a fetch brought
(`FetchResult`). Each transport serves the store and fetches payloads (hivemind/weights.py,
grpc/weights.py); what a fetch brought is rebuilt by `RebuildingClient` (rebuilding_client.py).

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
undo.py) with a small cache of the versions rebuilt last. A reader that must not wait (the
training thread verifying a group, a weight server answering a request) asks `state_now`: a
version at most INLINE_UNDO_DELTAS undo deltas from a held state is rebuilt at once, an older one
by one background thread (background_rebuilds.py) while the reader goes on (a verification is
deferred, a request answered busy).
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
    ChunkBook,
    ChunkSpec,
)
from swarm.fabric.weights.delta import (
    MAX_PAYLOAD_BYTES,
    CorruptVersion,
    encode_delta,
    encode_snapshot,
    state_hash,
)
from swarm.fabric.weights.background_rebuilds import BackgroundRebuilds
from swarm.fabric.weights.undo import UndoDelta, apply_chain, encode_undo
from swarm.fabric.weights.upload_slots import HolderBusy
from swarm.heap import give_back_free_heap

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
# The most undo deltas a reader that must not wait (state_now) has applied in its own thread; an
# older version is rebuilt in the background. At Qwen3-0.6B shape one undo delta takes ~1.2 s on
# a busy 2-core machine and the copy and hash of a state ~6 s: 4 bound a verification's wait to
# ~11 s there instead of the 83 s the oldest of 65 took (benchmarks/version_memory.py).
INLINE_UNDO_DELTAS = 4


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
    passed_over: list[str] = field(default_factory=list)  # in chunks: upstreams left for being far slower than the one before

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
        if self.passed_over:
            fields["passed_over"] = list(self.passed_over)
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

    def now(self, version: int) -> dict[str, torch.Tensor] | None:
        """The weights of held `version` if they come without a long rebuild, else None (and its
        rebuild under way in the background): VersionStore.state_now."""
        return self._store.state_now(version)

    def available_now(self, version: int) -> bool:
        """Whether `now(version)` would return at once (or the version is not held: nothing to wait for)."""
        return self._store.available_now(version)

    def release(self, version: int) -> None:
        """No reader is coming back for `version`: VersionStore.release."""
        self._store.release(version)

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
    send it anyway once the chain outweighs one (None: every held version's). inline_undo: the most
    undo deltas `state_now` applies in the asking thread (older versions are rebuilt by a
    background thread, BackgroundRebuilds, and the asker told to come back); None: no limit,
    every rebuild in the asking thread."""

    def __init__(self, capacity: int = 8, *, whole_states: int | None = None, cached_states: int = 1,
                 delta_budget: float | None = None, inline_undo: int | None = INLINE_UNDO_DELTAS) -> None:
        if whole_states is not None and whole_states < 1:
            raise ValueError(f"whole_states must be at least 1 (the newest version is always held whole), not {whole_states}")
        if inline_undo is not None and inline_undo < 0:
            raise ValueError(f"inline_undo must be at least 0 undo deltas (or None: no limit), not {inline_undo}")
        self.capacity, self.whole_states, self.cached_states, self.delta_budget = capacity, whole_states, cached_states, delta_budget
        self.inline_undo = inline_undo
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
        self.behind = BackgroundRebuilds(self)  # long rebuilds, for readers that must not wait (state_now)
        self.undo_applied = {"inline": 0, "background": 0}  # undo deltas applied, by where (a reader's thread or behind)
        # version -> its snapshot payload encoded elsewhere, or None (then here): a publisher's encoding process
        self.snapshot_encoder: Callable[[int], bytes | None] | None = None

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
        # a demoted whole state and the encoders' arrays are freed now: gigabytes at 0.6B, which glibc
        # would otherwise keep resident (swarm.heap)
        give_back_free_heap()
        return digest

    def _evict(self) -> None:
        """Drops the oldest versions past `capacity` and forward deltas past `delta_budget` (under the lock)."""
        while len(self.hashes) > self.capacity:
            old = next(iter(self.hashes))
            for held in (self.hashes, self._added_at, self._whole, self._undo, self._cache, self.deltas, self.bases):
                held.pop(old, None)
            self.behind.forget(old)
        if self.delta_budget is not None:
            kept, budget = 0, self.delta_budget * self._state_bytes
            for v in sorted(self.deltas, reverse=True):
                kept += len(self.deltas[v])
                if kept > budget:
                    del self.deltas[v], self.bases[v]
        for v in [v for v in self.deltas if v not in self.hashes]:
            del self.deltas[v], self.bases[v]

    def held_bytes(self) -> dict[str, int]:
        """What the held versions take, in bytes: whole states, rebuilt ones cached (here and
        behind: those rebuilt in the background and not yet read), undo and forward deltas."""
        with self.lock:
            return {"whole": len(self._whole) * self._state_bytes,
                    "cached": (len(self._cache) + self.behind.held()) * self._state_bytes,
                    "undo": sum(u.nbytes for u in self._undo.values()), "deltas": sum(map(len, self.deltas.values()))}

    def ready(self, version: int) -> bool:
        """Whether held `version` is whole or cached (or rebuilt behind): `state` returns it without rebuilding."""
        with self.lock:
            return version in self._whole or version in self._cache or self.behind.peek(version) is not None

    def _held_state(self, version: int, *, read: bool = True) -> dict[str, torch.Tensor] | None:
        """Under the lock: `version` whole, cached or rebuilt behind (`read`: a reader takes it), else None."""
        found = self._whole.get(version)
        if found is None and version in self._cache:
            self._cache.move_to_end(version)
            found = self._cache[version]
        if found is None:
            found = self.behind.take(version) if read else self.behind.peek(version)
        return found

    def _chain_to(self, version: int, extra: tuple[int, dict] | None = None) -> tuple[int, dict, list[UndoDelta]]:
        """Under the lock: the nearest newer state `version` is rebuilt from (whole, cached, rebuilt
        behind, or `extra`: (version, state) a rebuilder holds) and the undo deltas from it back to
        `version`, newest first: (its version, its state, the chain). KeyError: not held."""
        if version not in self.hashes:
            raise KeyError(f"version {version} is not held here")
        chain, start = [], version
        while True:
            base = self._held_state(start, read=False)
            if base is None and extra is not None and extra[0] == start:
                base = extra[1]
            if base is not None:
                return start, base, chain
            if start not in self._undo:
                raise KeyError(f"version {version} is held but cannot be rebuilt (no undo delta of {start})")
            undo = self._undo[start]
            if undo.newer <= start:  # (never: each is rebuilt from a newer version)
                raise CorruptVersion(f"undo delta held for version {start} is from version {undo.newer}")
            chain.append(undo)
            start = undo.newer

    def rebuild_cost(self, version: int) -> int:
        """How many undo deltas rebuilding held `version` applies now (0: whole or cached). KeyError: not held."""
        with self.lock:
            return len(self._chain_to(version)[2])

    def available_now(self, version: int) -> bool:
        """Whether `state_now(version)` returns the weights at once, or at the cost of at most
        `inline_undo` undo deltas (True too for a version not held: state_now raises at once)."""
        with self.lock:
            if version not in self.hashes:
                return True
            return self.inline_undo is None or len(self._chain_to(version)[2]) <= self.inline_undo

    def state_now(self, version: int) -> dict[str, torch.Tensor] | None:
        """The weights of held `version` for a reader that must not wait long (KeyError: not held):
        whole, cached or rebuilt behind at once; within `inline_undo` undo deltas of one of those,
        rebuilt here (`state`); further, None: its rebuild is under way in the background thread
        (BackgroundRebuilds), and a later call returns it. The rebuilt version is kept behind until
        read (and a while after), so a reader that comes back finds it."""
        with self.lock:
            found = self._held_state(version)
            if found is not None:
                return found
            cost = len(self._chain_to(version)[2])
        if self.inline_undo is None or cost <= self.inline_undo:
            return self.state(version)
        self.behind.request(version)
        return None

    def release(self, version: int) -> None:
        """No reader is coming back for held `version` (the groups deferred for it were dropped): its
        background rebuild is no longer asked for, and a rebuilt copy nobody read is dropped, rather
        than holding the rebuilding thread's room for HOLD_S while other versions wait."""
        self.behind.forget(version)

    def _rebuild(self, version: int, extra: tuple[int, dict] | None = None, *, where: str = "inline") -> dict[str, torch.Tensor]:
        """Held `version` rebuilt from the nearest newer state (`_chain_to`), its hash checked; not
        cached (the caller keeps it where it belongs). `where`: whose count of applied undo deltas."""
        with self.lock:
            start, base, chain = self._chain_to(version, extra)
            base_hash, want = self.hashes[start], self.hashes[version]
        if not chain:
            return base
        state = apply_chain(base, base_hash, chain[::-1])
        with self.lock:
            self.undo_applied[where] += len(chain)
        if state_hash(state) != want:
            raise CorruptVersion(f"version {version} rebuilt through {len(chain)} undo deltas does not match its hash")
        return state

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
            found = self._held_state(version)
            if found is not None:
                return found
            if version not in self.hashes:
                raise KeyError(f"version {version} is not held here")
        with self._rebuilding:
            with self.lock:  # (another thread may have rebuilt it meanwhile)
                found = self._held_state(version)
                if found is not None:
                    return found
            state = self._rebuild(version)
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
        """The snapshot of held `version`. HolderBusy (ask again shortly: no blame) while an old
        version is rebuilt in the background: a request must not hold its server thread (and
        upload slot) for a rebuild through tens of undo deltas (state_now)."""
        cached = self._snapshot
        if cached is not None and cached[0] == version:
            return cached[1]
        encoder = self.snapshot_encoder
        snapshot = encoder(version) if encoder is not None else None
        if snapshot is None:
            state = self.state_now(version)
            if state is None:
                raise HolderBusy(f"version {version} is being rebuilt here from undo deltas; ask again shortly")
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
