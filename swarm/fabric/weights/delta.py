"""Policy versions on the wire: a full snapshot, or a compact delta against the previous published
version, such that every receiver reconstructs the published weights bit for bit.

Deltas compare raw bits, not values: each tensor is viewed as unsigned integers of its element
width and the elements whose bits changed are listed ("sparse"), or the whole tensor is sent
("dense") when listing would be larger. At RL learning rates few bf16 elements change between
consecutive versions, and nearly every one that does moves by one representable value (its fp32
master weight crossed a bf16 rounding boundary). So a delta carries where the changes are and by
how many steps each element moved, coded for that:
- steps: a float's bits are mapped to an integer that orders like the float (non-negative: the
  bits as they are; negative: the magnitude bits inverted, so -0.0 -> -1 and the smallest negative
  subnormal -> -2), and the step is the difference of those integers modulo 2^width: exact for
  every bit pattern (NaNs and infinities included), +-1 for a one-ulp move, across zero and
  exponent boundaries too. Integer and bool tensors use their bits' difference. Steps are
  zigzag-mapped (0, -1, +1, -2, ... -> 0, 1, 2, 3, ...) and written as LEB128 varints: one byte
  for moves of up to 63 steps.
- positions: an element's chance of changing is about (update size) / (its ulp), and its ulp is
  set by its exponent, which the receiver knows from the base: elements near zero change at almost
  every step, elements of typical size at a few percent. So the changed elements are listed per
  class, a class being one of four ranges of exponents of one dtype (value_classes.RANGES; the
  encoder picks the ranges that fit the data and sends them: a float dtype's three thresholds) or
  one integer dtype, across all sparse tensors: class by class, tensor by tensor (in name order,
  each cut into CHUNK-element pieces), counting within the class's members (in index order). What
  goes on the wire is the gaps between consecutive changed members of a class, minus one, as
  varints, then the steps in the same order.
zlib then codes each stream to within ~12% of its entropy given the class (benchmarks/
delta_scale.md, a 49M-parameter Qwen3 at lr 1e-6: about 7 bits per changed element, against 10
with the gaps in index order and 26 for format 2). Every version is named by a hash of its exact
contents (`state_hash`, BLAKE3); `apply_payload` checks the base it is applied to and the result,
so a corrupt or misapplied delta is never used.

Layout of a payload: one codec byte, b"C" (a delta: its large byte strings compressed one by one)
or b"R" (a snapshot, raw: weights are high-entropy, zlib saves ~20% of a bf16 snapshot at ~40x the
time of sending it on a fast link), then a msgpack map:
  v int (format), kind "delta" | "snapshot", version int, base int | None, base_hash str | None,
  hash str, tensors: [ {n name, d dtype, s shape, k "same" | "sparse" | "dense", b bits (dense
  only, little-endian)} ], for deltas with changed float tensors: ranges {dtype: [3 thresholds]}
  (range r of a dtype holds the exponents e with r thresholds <= e), and for deltas with sparse
  tensors: classes [[class, count], ...]
  (ascending classes, the number of changed elements of each), gaps bytes, steps bytes.
In a delta, gaps, steps and each dense b are lists of segments, [raw size, zlib stream] pairs of at
most SEGMENT bytes each: compressed and decompressed each on its own thread, and bounded (the sizes
are checked before anything inflates; wire_layout.py).
Format 4 replaced format 3's zlib over the whole msgpack body (b"Z": one stream, on one core) and
its sha256 hash (BLAKE3 is two to three times faster); format 5 (this one) counts positions within
four ranges of exponents per dtype instead of each of 256 exponents (format 4's classes), which
both ends had to sort elements by: 9% more bytes at Qwen3-0.6B shape (19.38 against 17.74 MB; format
3 sent 22.49), a few ns less CPU an element at each end.
Receivers refuse payloads of any other format, saying which peer is behind.

Speed (the wire format does not depend on any of this): no sort of the elements at either end.
With numba (kernels.py, compiled on first use and cached), one pass over a piece's elements does
the work: on encode, the comparison of old and new bits, each element's class from its magnitude
(three compares with the ranges' thresholds), its rank within its class (the four classes' counts
packed in one int64), the zigzag steps, then the class-by-class varints of gaps and steps; on
apply, the copy of the base into the new state, the walk over each class's members that places
the changes, and the steps added. Without numba the numpy path does the same in whole-array
passes, RUN elements at a time (value_classes.ranked: three ranges' counts packed in an int64;
value_classes.target_index), writing the same bytes. Pieces are spread over THREADS threads (the
kernels, numpy's comparisons, sums and gathers, BLAKE3 and zlib release the GIL); streams are kept
as varint bytes and each is compressed from the pieces it was made in (packed_stream.py).
The applying side is delta_apply.py; the state's bits, pieces, threads and hashes are state_bits.py.
Where the time goes (benchmarks/delta_speed.py, Qwen3-0.6B shape, 4% changed, a very busy 2-core
machine, CPU seconds): encode with both hashes 3.3 s (numpy path 5.6), apply with its checks 5.3
(numpy path 6.1); one 30M tensor on one thread: encode 4.8 ns an element (numpy 7.7), apply with
the result's hash 4.8 (numpy 9.5). Ranking ~1.5-3 ns an element (one mispredicted branch per
change), applying ~2.5, BLAKE3 ~0.5 a state, zlib and varints a few percent.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple

import msgpack
import numpy as np
import torch

from swarm.fabric.weights import kernels, state_bits
# the applying side and the state's bits and hashes live beside this module; their names are this module's interface too
from swarm.fabric.weights.delta_apply import apply_payload, apply_payload_verified, payload_header  # noqa: F401
from swarm.fabric.weights.packed_stream import Bin, packed
from swarm.fabric.weights.state_bits import (  # noqa: F401  (DTYPES, FLOATS, THREADS, the hashes: this module's interface too)
    CHUNK,
    DTYPES,
    FLOATS,
    INT,
    THREADS,
    UINT,
    legacy_state_hash,
    non_finite_tensors,
    pieces,
    raw_bits,
    state_hash,
    tensor_from_bits,
    workers,
)
from swarm.fabric.weights.value_classes import (  # noqa: F401
    CLASS_BITS,
    CLASSES,
    EXPONENTS,
    NUM_CLASSES,
    SAMPLE_STRIDE,
    ordered,
    pick_thresholds,
    ranked,
    thresholds_from_counts,
)

# varint_encode and varint_decode are part of this module's interface too (the tests and benchmarks use them)
from swarm.fabric.weights.varints import varint_array, varint_bytes, varint_decode, varint_encode, varint_sizes, zigzag  # noqa: F401
from swarm.fabric.weights.wire_layout import (  # noqa: F401  (FORMAT, the codecs, delta_body, delta_payload: this module's interface too)
    DELTA_CODEC,
    FORMAT,
    FORMAT_3_DELTA_CODEC,
    MAX_PAYLOAD_BYTES,
    SEGMENT,
    SNAPSHOT_CODEC,
    ZLIB_LEVEL,
    ZLIB_STRATEGY,
    CorruptVersion,
    UnsupportedFormat,
    compressed_segments,
    delta_body,
    delta_payload,
    resolved,
)


# the names these had when they lived here (benchmarks and tests read them)
_bits, _from_bits, _UINT, _INT, _pieces = raw_bits, tensor_from_bits, UINT, INT, pieces


def entropy_bits(values: np.ndarray) -> float:
    """Shannon entropy of the empirical distribution of `values`, in bits per value."""
    if values.size == 0:
        return 0.0
    _, counts = np.unique(values, return_counts=True)
    p = counts / values.size
    return float(-(p * np.log2(p)).sum())


def log2_binomial(n: int, k: int) -> float:
    """log2 C(n, k): the bits needed to name which k of n positions changed."""
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


class _Changes(NamedTuple):
    """A piece's changed elements, class by class, coded as far as the piece alone allows."""
    members: np.ndarray    # of each of the dtype's classes in the piece (int64)
    classes: np.ndarray    # the classes with changes (ascending)
    changed: np.ndarray    # changes in each of them
    firsts: np.ndarray     # the rank of each one's first change
    lasts: np.ndarray      # and of its last
    gaps: np.ndarray       # varints (uint8): the gaps within each class, its first one a 1-byte placeholder
    gap_ends: np.ndarray   # where each class's gaps end in `gaps`
    steps: np.ndarray      # varints of the zigzag steps
    step_ends: np.ndarray
    size: int              # the sparse size estimate (see encode_delta)


def _segment_ends(lengths: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Where each run of varints (given by its first) ends, in bytes."""
    if starts.size == 0:
        return np.empty(0, np.int64)
    return np.cumsum(np.add.reduceat(lengths, starts, dtype=np.int64))


def _piece_changes(old: np.ndarray, new: np.ndarray, dtype: torch.dtype, thresholds: list[int] | None) -> _Changes:
    """The changes of one piece of a tensor (its bits before and after; its dtype's ranges)."""
    if kernels.ENABLED:
        return _compiled_piece_changes(old, new, dtype, thresholds)
    count = CLASSES[dtype][1]
    cls, rank, index, members = ranked(old, new, dtype, thresholds)
    is_float = dtype in FLOATS
    steps = zigzag(ordered(new[index], is_float) - ordered(old[index], is_float))
    changed = np.bincount(cls, minlength=count)
    classes = np.flatnonzero(changed)
    ends = np.cumsum(changed[classes])
    starts = ends - changed[classes]
    # gaps between consecutive changes of a class; each class's first gap counts from the class's
    # last change in earlier pieces, so it is written when the piece is added (_SparseEncoder.add)
    gaps = np.empty(rank.size, np.uint32 if state_bits.CHUNK <= 1 << 32 else np.uint64)
    np.subtract(rank[1:], rank[:-1], out=gaps[1:], casting="unsafe")
    gaps[1:] -= 1
    gaps[starts] = 0
    gap_bytes, gap_lengths = varint_array(gaps)
    step_bytes, step_lengths = varint_array(steps)
    firsts, lasts = rank[starts], rank[ends - 1]
    return _Changes(members, classes, changed[classes], firsts, lasts, gap_bytes, _segment_ends(gap_lengths, starts),
                    step_bytes, _segment_ends(step_lengths, starts),
                    _size_estimate(members, classes, firsts, lasts, gap_bytes.size, step_bytes.size))


def _compiled_piece_changes(old: np.ndarray, new: np.ndarray, dtype: torch.dtype, thresholds: list[int] | None) -> _Changes:
    """_piece_changes in two compiled passes (kernels.py): the same _Changes."""
    count = CLASSES[dtype][1]
    bounds = kernels.class_bounds(old.dtype, thresholds, EXPONENTS[dtype][0] if thresholds is not None else None)
    members, cls, rank, steps = kernels.ranked_changes(old, new, bounds, dtype in FLOATS)
    changed, firsts, lasts, gap_bytes, gap_ends, step_bytes, step_ends = kernels.class_streams(cls, rank, steps, count)
    del cls, rank, steps
    members = members[:count]
    classes = np.flatnonzero(changed)
    firsts, lasts = firsts[classes], lasts[classes]
    return _Changes(members, classes, changed[classes], firsts, lasts, gap_bytes, gap_ends[classes], step_bytes,
                    step_ends[classes], _size_estimate(members, classes, firsts, lasts, gap_bytes.size, step_bytes.size))


def _size_estimate(members: np.ndarray, classes: np.ndarray, firsts: np.ndarray, lasts: np.ndarray, gap_bytes: int,
                   step_bytes: int) -> int:
    """The sparse size estimate, as format 3 has always made it: varints of the gaps between
    consecutive changes of the piece in class-sorted order (across classes too) and of the steps
    (the piece's gap bytes hold one placeholder byte per class instead of its first gap)."""
    offsets = np.cumsum(members) - members
    across = offsets[classes] + firsts - np.concatenate(([-1], offsets[classes[:-1]] + lasts[:-1])) - 1
    return gap_bytes - classes.size + int(varint_sizes(across).sum()) + step_bytes


class _SparseEncoder:
    """The class-by-class streams of a delta, built from its sparse tensors' pieces in wire order."""

    def __init__(self) -> None:
        self.members = np.zeros(NUM_CLASSES, np.int64)  # of each class in the pieces added so far
        self.last = np.full(NUM_CLASSES, -1, np.int64)  # position of each class's last change so far
        self.changed = np.zeros(NUM_CLASSES, np.int64)
        self.gaps: dict[int, list] = {}  # per class: its gap varints, in pieces
        self.steps: dict[int, list] = {}

    def add(self, piece: _Changes, dtype: torch.dtype) -> None:
        first = CLASSES[dtype][0]
        ids = piece.classes + first
        before = self.members[ids]
        heads = (before + piece.firsts - self.last[ids] - 1).tolist()  # each class's first gap in this piece
        gap_starts = np.concatenate(([0], piece.gap_ends[:-1])).tolist()
        step_starts = np.concatenate(([0], piece.step_ends[:-1])).tolist()
        for c, head, g0, g1, s0, s1 in zip(ids.tolist(), heads, gap_starts, piece.gap_ends.tolist(), step_starts,
                                           piece.step_ends.tolist()):
            self.gaps.setdefault(c, []).extend((varint_bytes(head), piece.gaps[g0 + 1:g1]))  # + 1: the placeholder
            self.steps.setdefault(c, []).append(piece.steps[s0:s1])
        self.last[ids] = before + piece.lasts
        self.changed[ids] += piece.changed
        self.members[first:first + piece.members.size] += piece.members

    def streams(self) -> dict:
        if not self.gaps:
            return {}
        ids = sorted(self.gaps)
        return {"classes": [[c, int(self.changed[c])] for c in ids],
                "gaps": Bin([chunk for c in ids for chunk in self.gaps[c]]),
                "steps": Bin([chunk for c in ids for chunk in self.steps[c]])}


def encode_snapshot(state: Mapping[str, torch.Tensor], version: int) -> bytes:
    tensors = [{"n": n, "d": str(t.dtype), "s": list(t.shape), "k": "dense", "b": Bin([raw_bits(t).view(np.uint8)])}
               for n, t in sorted(state.items())]
    body = {"v": FORMAT, "kind": "snapshot", "version": version, "base": None, "base_hash": None,
            "hash": state_hash(state), "tensors": tensors}
    # msgpack.packb's bytes, packed in pieces and joined once: the bits are copied once, into the
    # payload (packb grows a buffer and copies it out: twice a snapshot's size at its peak)
    return b"".join([SNAPSHOT_CODEC, *packed(body, msgpack.Packer(use_bin_type=True))])


def _picked_ranges(changed: list) -> dict:
    """The ranges of each float dtype among the changed tensors, picked from a sample of their
    elements (one in SAMPLE_STRIDE)."""
    if kernels.ENABLED:
        counts: dict = {}
        for _, old_bits, new_bits, dtype in changed:
            if dtype in EXPONENTS:
                shift, mask = EXPONENTS[dtype]
                members, hits = counts.setdefault(dtype, (np.zeros(mask + 1, np.int64), np.zeros(mask + 1, np.int64)))
                kernels.sample_exponents(old_bits, new_bits, shift, mask, SAMPLE_STRIDE, members, hits)
        return {dtype: thresholds_from_counts(members, hits) for dtype, (members, hits) in counts.items()}
    samples: dict = {}
    for _, old_bits, new_bits, dtype in changed:
        if dtype in EXPONENTS:
            samples.setdefault(dtype, []).append((old_bits[::SAMPLE_STRIDE], new_bits[::SAMPLE_STRIDE]))
    return {dtype: pick_thresholds(np.concatenate([o for o, _ in pairs]), np.concatenate([n for _, n in pairs]), dtype)
            for dtype, pairs in samples.items()}


def encode_delta(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *, base_version: int, version: int,
                 level: int = ZLIB_LEVEL, base_hash: str | None = None, new_hash: str | None = None) -> bytes:
    """A delta turning `base` (published as `base_version`) into `new` (`version`), bit for bit.
    `base_hash`, `new_hash`: state_hash(base) and state_hash(new), when the caller knows them
    already (saves hashing the states: a store encoding undo deltas between versions it hashed)."""
    if set(base) != set(new):
        raise ValueError(f"tensor names differ between versions: {sorted(set(base) ^ set(new))[:5]}")
    names = sorted(new)
    for name in names:
        a, b = base[name], new[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            raise ValueError(f"{name}: {a.dtype}{tuple(a.shape)} -> {b.dtype}{tuple(b.shape)}; send a snapshot instead")
    with workers() as pool:
        hashes = (pool.submit(lambda: base_hash) if base_hash is not None else pool.submit(state_hash, base)), \
            (pool.submit(lambda: new_hash) if new_hash is not None else pool.submit(state_hash, new))
        tensors, changed = [], []
        for name in names:
            old_bits, new_bits = raw_bits(base[name]), raw_bits(new[name])
            entry = {"n": name, "d": str(new[name].dtype), "s": list(new[name].shape)}
            tensors.append(entry)
            if kernels.equal(old_bits, new_bits) if kernels.ENABLED else np.array_equal(old_bits, new_bits):
                entry["k"] = "same"
                continue
            changed.append((entry, old_bits, new_bits, new[name].dtype))
        ranges = _picked_ranges(changed)
        work = []
        for entry, old_bits, new_bits, dtype in changed:  # the pool codes every changed tensor's pieces meanwhile
            coded = [pool.submit(_piece_changes, old_bits[s:e], new_bits[s:e], dtype, ranges.get(dtype))
                     for s, e in pieces(new_bits.size)] if dtype in CLASSES else []
            work.append((entry, new_bits, dtype, coded))
        sparse = _SparseEncoder()
        for entry, new_bits, dtype, coded in work:  # in name order: a class's positions count across tensors
            changes = [future.result() for future in coded]
            if changes and sum(c.size for c in changes) < new_bits.nbytes:
                entry["k"] = "sparse"
                for piece in changes:
                    sparse.add(piece, dtype)
            else:
                entry.update(k="dense", b=compressed_segments([new_bits.view(np.uint8)], level, pool))
        streams = sparse.streams()
        if ranges:  # (every changed float dtype's: the sparse or dense choice depends on them)
            streams = {"ranges": {str(d): ranges[d] for d in sorted(ranges, key=str)}, **streams}
        for key in ("gaps", "steps"):  # compressed side by side
            if key in streams:
                streams[key] = compressed_segments(streams[key].chunks, level, pool)
        body = resolved({"v": FORMAT, "kind": "delta", "version": version, "base": base_version,
                          "base_hash": hashes[0].result(), "hash": hashes[1].result(), "tensors": tensors, **streams})
    return DELTA_CODEC + msgpack.packb(body, use_bin_type=True)


