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
  class, a class being one exponent value of one dtype, across all sparse tensors: class by class,
  tensor by tensor (in name order, each cut into CHUNK-element pieces), counting within the
  class's members (in index order). What goes on the wire is the gaps between consecutive changed
  members of a class, minus one, as varints, then the steps in the same order.
zlib then codes the streams to within ~12% of their entropy given the class (benchmarks/
delta_scale.md, a 49M-parameter Qwen3 at lr 1e-6: about 7 bits per changed element, against 10
with the gaps in index order and 26 for format 2). Every version is named by a hash of its exact
contents (`state_hash`); `apply_payload` checks the base it is applied to and the result, so a
corrupt or misapplied delta is never used.

Layout of a payload: one codec byte, b"Z" (zlib-compressed, for deltas) or b"R" (raw, for
snapshots: weights are high-entropy, zlib saves ~20% of a bf16 snapshot at ~40x the time of
sending it on a fast link), then a msgpack map:
  v int (format), kind "delta" | "snapshot", version int, base int | None, base_hash str | None,
  hash str, tensors: [ {n name, d dtype, s shape, k "same" | "sparse" | "dense", b bits (dense
  only, little-endian)} ], and for deltas with sparse tensors: classes [[class, count], ...]
  (ascending classes, the number of changed elements of each), gaps bytes, steps bytes.
Format 3 (this one) replaced format 2's sparse entries (uint32 gaps and the new bits, per
tensor); receivers refuse payloads of any other format.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from typing import Mapping

import msgpack
import numpy as np
import torch

FORMAT = 3
# No weight payload, received or decompressed, may be larger than this: a hostile holder must not
# make a peer allocate without bound. 4 GiB covers a float16 snapshot of a 2B-parameter policy;
# peers pass a tighter bound from their own model's shapes (versions.payload_limit).
MAX_PAYLOAD_BYTES = 4 * 1024**3
DTYPES = {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16,
          "torch.int64": torch.int64, "torch.int32": torch.int32, "torch.uint8": torch.uint8, "torch.bool": torch.bool}
FLOATS = {torch.float32, torch.bfloat16, torch.float16}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
# position classes: (first class id, number of classes, shift of the exponent field, its mask) per dtype
_CLASSES = {torch.bfloat16: (0, 256, 7, 0xFF), torch.float32: (256, 256, 23, 0xFF), torch.float16: (512, 32, 10, 0x1F),
            torch.int64: (544, 1, 0, 0), torch.int32: (545, 1, 0, 0), torch.uint8: (546, 1, 0, 0), torch.bool: (547, 1, 0, 0)}
NUM_CLASSES = 548
# sparse tensors are listed in pieces of at most this many elements (bounds the encoder's and the
# receiver's working memory: an index array of 8 bytes an element per piece)
CHUNK = 1 << 22
# zlib's string matching finds runs (classes whose elements nearly all change), its Huffman stage
# the skewed byte values. Z_FILTERED favours the latter: on these streams it is the smallest of
# zlib's strategies, and at level 4 within 2% of level 6 in a third of the time.
ZLIB_STRATEGY = zlib.Z_FILTERED
ZLIB_LEVEL = 4


class CorruptVersion(ValueError):
    """A snapshot or delta that does not decode, or whose result does not match its hash."""


def _bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's raw bits as a flat unsigned-integer array (a view, no conversion of values)."""
    t = t.detach().contiguous().cpu()
    width = t.element_size()
    return t.view(-1).view(torch.uint8).numpy().view(_UINT[width])


def _from_bits(bits: np.ndarray, dtype: torch.dtype, shape, *, copy: bool = True) -> torch.Tensor:
    raw = np.ascontiguousarray(bits).view(np.uint8)
    return torch.from_numpy(raw.copy() if copy else raw).view(dtype).reshape(shape)


# ---------------------------------------------------------------------------------------------
# the sparse coding's pieces, vectorised (no Python loop over elements)

def ordered(bits: np.ndarray, is_float: bool) -> np.ndarray:
    """Float bits -> unsigned integers whose two's-complement reading orders like the floats
    (non-negative: unchanged; negative: the magnitude bits inverted). An involution: applying it
    again gives the bits back. Other dtypes: the bits themselves."""
    if not is_float:
        return bits
    width = bits.dtype.itemsize * 8
    low = bits.dtype.type((1 << (width - 1)) - 1)
    return bits ^ ((bits >> bits.dtype.type(width - 1)) * low)


def zigzag(step: np.ndarray) -> np.ndarray:
    """Unsigned w-bit steps read as two's complement -> 0, -1, +1, -2, ... as 0, 1, 2, 3, ..."""
    width = step.dtype.itemsize * 8
    signs = (step.view(_INT[step.dtype.itemsize]) >> (width - 1)).view(step.dtype)  # all ones where negative
    return (step << step.dtype.type(1)) ^ signs


def unzigzag(z: np.ndarray) -> np.ndarray:
    return (z >> z.dtype.type(1)) ^ (np.zeros_like(z) - (z & z.dtype.type(1)))


def varint_sizes(values: np.ndarray) -> np.ndarray:
    """Bytes each unsigned integer takes as a varint."""
    v = np.asarray(values).astype(np.uint64, copy=False)
    sizes = np.ones(v.shape, np.int64)
    for j in range(1, 10):
        more = v >= np.uint64(1 << (7 * j))
        if not more.any():
            break
        sizes += more
    return sizes


def varint_encode(values: np.ndarray) -> bytes:
    """Unsigned integers as LEB128 varints (7 bits a byte, low first, high bit set on all but the last)."""
    v = np.asarray(values).astype(np.uint64, copy=False).ravel()
    if v.size == 0:
        return b""
    lengths = varint_sizes(v)
    longest = int(lengths.max())
    if longest == 1:
        return v.astype(np.uint8).tobytes()
    starts = np.cumsum(lengths) - lengths
    out = np.empty(int(lengths.sum()), np.uint8)
    out[starts] = (v & np.uint64(0x7F)).astype(np.uint8) | ((lengths > 1).astype(np.uint8) << 7)
    for j in range(1, longest):
        rows = np.flatnonzero(lengths > j)
        byte = ((v[rows] >> np.uint64(7 * j)) & np.uint64(0x7F)).astype(np.uint8)
        out[starts[rows] + j] = byte | ((lengths[rows] > j + 1).astype(np.uint8) << 7)
    return out.tobytes()


def varint_decode(data, *, max_count: int, width_bits: int = 64) -> np.ndarray:
    """LEB128 varints -> uint64 array. ValueError when the data is truncated, holds more than
    `max_count` numbers, or a number wider than `width_bits` (memory is bounded by the data's size,
    whatever the data)."""
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"varints must be bytes, not {type(data).__name__}")
    buf = np.frombuffer(data, np.uint8)
    if buf.size == 0:
        return np.empty(0, np.uint64)
    last = buf < 0x80
    if not last[-1]:
        raise ValueError("truncated varint")
    count = int(np.count_nonzero(last))
    if count > max_count:
        raise ValueError(f"{count} varints where at most {max_count} fit")
    if count == buf.size:
        out = buf.astype(np.uint64)
    else:
        ends = np.flatnonzero(last)
        starts = np.empty_like(ends)
        starts[0] = 0
        starts[1:] = ends[:-1] + 1
        lengths = ends - starts + 1
        longest = int(lengths.max())
        if longest > (width_bits + 6) // 7:
            raise ValueError(f"a varint of {longest} bytes for a {width_bits}-bit number")
        out = (buf[starts] & 0x7F).astype(np.uint64)
        for j in range(1, longest):
            rows = np.flatnonzero(lengths > j)
            byte = buf[starts[rows] + j]
            if j == 9 and (byte > 1).any():
                raise ValueError("a varint wider than 64 bits")
            out[rows] |= (byte & 0x7F).astype(np.uint64) << np.uint64(7 * j)
    if width_bits < 64 and (out >> np.uint64(width_bits)).any():
        raise ValueError(f"a varint wider than {width_bits} bits")
    return out


def local_classes(bits: np.ndarray, dtype: torch.dtype) -> np.ndarray | None:
    """Each element's class within its dtype (the exponent field, uint8), or None for dtypes with
    one class."""
    _, count, shift, mask = _CLASSES[dtype]
    if count == 1:
        return None
    return ((bits >> bits.dtype.type(shift)) & bits.dtype.type(mask)).astype(np.uint8)


def _class_order(bits: np.ndarray, dtype: torch.dtype) -> tuple[np.ndarray | None, np.ndarray]:
    """(order, counts) of a piece: the element indices sorted by class, stably (None: the identity),
    and the number of elements of each of the dtype's classes."""
    local = local_classes(bits, dtype)
    if local is None:
        return None, np.array([bits.size], np.int64)
    return np.argsort(local, kind="stable"), np.bincount(local, minlength=_CLASSES[dtype][1]).astype(np.int64)


def _pieces(n: int):
    return [(start, min(start + CHUNK, n)) for start in range(0, n, CHUNK)] or [(0, 0)]


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


class _SparseEncoder:
    """Collects the changed elements of sparse tensors, piece by piece, and lays them out class by class."""

    def __init__(self) -> None:
        self.counts: list[tuple[int, np.ndarray]] = []  # per piece: (first class id, members per class)
        self.changes: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # per piece: class ids, ranks, zigzag steps

    def tensor(self, old_bits: np.ndarray, new_bits: np.ndarray, dtype: torch.dtype) -> int:
        """Add a tensor; returns its estimated sparse size in bytes (varints before compression)."""
        first, _, _, _ = _CLASSES[dtype]
        is_float = dtype in FLOATS
        size = 0
        for start, end in _pieces(old_bits.size):
            old, new = old_bits[start:end], new_bits[start:end]
            order, counts = _class_order(old, dtype)
            changed = old != new
            if order is None:
                sorted_pos = np.flatnonzero(changed)
                index = sorted_pos
            else:
                sorted_pos = np.flatnonzero(changed[order])
                index = order[sorted_pos]
            offsets = np.cumsum(counts) - counts
            local = np.searchsorted(offsets, sorted_pos, side="right") - 1  # the class of each, from its sorted position
            rank = sorted_pos - offsets[local]
            steps = zigzag(ordered(new[index], is_float) - ordered(old[index], is_float)).astype(np.uint64)
            size += int(varint_sizes(np.diff(sorted_pos, prepend=-1) - 1).sum() + varint_sizes(steps).sum())
            self.counts.append((first, counts))
            self.changes.append(((local + first).astype(np.uint16), rank, steps))
        return size

    def drop(self, pieces: int) -> None:
        del self.counts[len(self.counts) - pieces:], self.changes[len(self.changes) - pieces:]

    def streams(self) -> dict:
        if not self.changes:
            return {}
        table = np.zeros((len(self.counts) + 1, NUM_CLASSES), np.int64)  # members of each class before each piece
        for i, (first, counts) in enumerate(self.counts):
            table[i + 1, first:first + counts.size] = counts
        np.cumsum(table, axis=0, out=table)
        classes = np.concatenate([c for c, _, _ in self.changes])
        piece = np.repeat(np.arange(len(self.changes)), [c.size for c, _, _ in self.changes])
        position = table[piece, classes] + np.concatenate([r for _, r, _ in self.changes])
        steps = np.concatenate([s for _, _, s in self.changes])
        order = np.argsort(classes, kind="stable")  # class by class; within one, pieces and ranks ascending
        classes, position, steps = classes[order], position[order], steps[order]
        previous = np.empty_like(position)
        previous[1:] = position[:-1]
        first = np.ones(classes.size, bool)
        first[1:] = classes[1:] != classes[:-1]
        previous[first] = -1
        ids, counts = np.unique(classes, return_counts=True)
        return {"classes": [[int(c), int(k)] for c, k in zip(ids, counts)],
                "gaps": varint_encode(position - previous - 1), "steps": varint_encode(steps)}


def _apply_sparse(body: dict, targets: list[tuple[np.ndarray, torch.dtype]]) -> None:
    """Apply a delta's class-by-class streams to the bits of its sparse tensors (in entry order), in place."""
    pieces = [(bits, dtype, start, end) for bits, dtype in targets for start, end in _pieces(bits.size)]
    table = np.zeros((len(pieces) + 1, NUM_CLASSES), np.int64)
    for i, (bits, dtype, start, end) in enumerate(pieces):
        local = local_classes(bits[start:end], dtype)
        first, count, _, _ = _CLASSES[dtype]
        table[i + 1, first:first + count] = end - start if local is None else np.bincount(local, minlength=count)
    np.cumsum(table, axis=0, out=table)
    members = table[-1]
    listing = body.get("classes", [])
    if not isinstance(listing, list) or not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) for x in p)
                                                for p in listing):
        raise ValueError("classes is not a list of [class, count] pairs")
    ids = np.array([p[0] for p in listing], np.int64)
    counts = np.array([p[1] for p in listing], np.int64)
    if ids.size and ((ids < 0).any() or (ids >= NUM_CLASSES).any() or (np.diff(ids) <= 0).any()):
        raise ValueError("classes are not ascending class ids")
    if ((counts < 1) | (counts > members[ids])).any():
        raise ValueError("a class lists more changed elements than it has")
    total = int(counts.sum())
    gaps = varint_decode(body.get("gaps", b""), max_count=total)
    steps = varint_decode(body.get("steps", b""), max_count=total)
    if gaps.size != total or steps.size != total:
        raise ValueError(f"{total} changed elements listed, {gaps.size} gaps and {steps.size} steps sent")
    if not total:
        return
    classes = np.repeat(ids, counts)
    limit = members[classes].astype(np.uint64)
    if (gaps >= limit).any():
        raise ValueError("a gap runs past its class")
    # position within the class: running sums restarted at each class (modulo 2^64; every position
    # is checked below, and no step is large enough to wrap past the check)
    running = np.cumsum(gaps + np.uint64(1))
    starts = np.cumsum(counts) - counts
    before = np.where(starts > 0, running[starts - 1], np.uint64(0))
    position = running - np.repeat(before, counts) - np.uint64(1)
    if (position >= limit).any():
        raise ValueError("a position runs past its class")
    position = position.astype(np.int64)
    piece = np.empty(total, np.int64)
    for c, s, k in zip(ids.tolist(), starts.tolist(), counts.tolist()):
        piece[s:s + k] = np.searchsorted(table[1:, c], position[s:s + k], side="right")
    rank = position - table[piece, classes]
    order = np.argsort(piece.astype(np.uint16) if len(pieces) <= 2**16 else piece, kind="stable")  # 16 bits: a radix sort
    bounds = np.searchsorted(piece[order], np.arange(len(pieces) + 1))
    for i, (bits, dtype, start, end) in enumerate(pieces):
        mine = order[bounds[i]:bounds[i + 1]]
        if mine.size == 0:
            continue
        first, count, _, _ = _CLASSES[dtype]
        piece_bits = bits[start:end]
        local = local_classes(piece_bits, dtype)
        piece_counts = table[i + 1, first:first + count] - table[i, first:first + count]
        sorted_pos = (np.cumsum(piece_counts) - piece_counts)[classes[mine] - first] + rank[mine]
        index = sorted_pos if local is None else np.argsort(local, kind="stable")[sorted_pos]
        z = steps[mine]
        width = bits.dtype.itemsize * 8
        if width < 64 and (z >> np.uint64(width)).any():
            raise ValueError(f"a step wider than {width} bits")
        is_float = dtype in FLOATS
        step = unzigzag(z.astype(bits.dtype))
        piece_bits[index] = ordered(ordered(piece_bits[index], is_float) + step, is_float)


# ---------------------------------------------------------------------------------------------

def non_finite_tensors(state: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors of `state` that hold a NaN or an infinity."""
    return [name for name, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def state_hash(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(_bits(t).tobytes())
    return h.hexdigest()


def encode_snapshot(state: Mapping[str, torch.Tensor], version: int) -> bytes:
    tensors = [{"n": n, "d": str(t.dtype), "s": list(t.shape), "k": "dense", "b": _bits(t).tobytes()} for n, t in sorted(state.items())]
    body = {"v": FORMAT, "kind": "snapshot", "version": version, "base": None, "base_hash": None,
            "hash": state_hash(state), "tensors": tensors}
    return b"R" + msgpack.packb(body, use_bin_type=True)


def encode_delta(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *, base_version: int, version: int,
                 level: int = ZLIB_LEVEL) -> bytes:
    """A delta turning `base` (published as `base_version`) into `new` (`version`), bit for bit."""
    if set(base) != set(new):
        raise ValueError(f"tensor names differ between versions: {sorted(set(base) ^ set(new))[:5]}")
    tensors = []
    sparse = _SparseEncoder()
    for name in sorted(new):
        a, b = base[name], new[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            raise ValueError(f"{name}: {a.dtype}{tuple(a.shape)} -> {b.dtype}{tuple(b.shape)}; send a snapshot instead")
        old_bits, new_bits = _bits(a), _bits(b)
        entry = {"n": name, "d": str(b.dtype), "s": list(b.shape)}
        tensors.append(entry)
        if np.array_equal(old_bits, new_bits):
            entry["k"] = "same"
        elif b.dtype in _CLASSES and sparse.tensor(old_bits, new_bits, b.dtype) < new_bits.nbytes:
            entry["k"] = "sparse"
        else:
            if b.dtype in _CLASSES:
                sparse.drop(len(_pieces(new_bits.size)))
            entry.update(k="dense", b=new_bits.tobytes())
    body = {"v": FORMAT, "kind": "delta", "version": version, "base": base_version, "base_hash": state_hash(base),
            "hash": state_hash(new), "tensors": tensors, **sparse.streams()}
    packer = zlib.compressobj(level, zlib.DEFLATED, zlib.MAX_WBITS, 9, ZLIB_STRATEGY)
    return b"Z" + packer.compress(msgpack.packb(body, use_bin_type=True)) + packer.flush()


def payload_header(payload: bytes, max_bytes: int = MAX_PAYLOAD_BYTES) -> dict:
    """kind, version, base, base_hash, hash of a payload (decodes it; raises CorruptVersion)."""
    body = _load(payload, max_bytes)
    return {k: body[k] for k in ("kind", "version", "base", "base_hash", "hash")}


def _inflate(data, max_bytes: int) -> bytes:
    """zlib data decompressed, refusing output beyond `max_bytes` (a few KB of zeros could
    otherwise inflate to gigabytes)."""
    inflater = zlib.decompressobj()
    out = inflater.decompress(data, max_bytes)
    if inflater.unconsumed_tail:
        raise CorruptVersion(f"payload decompresses to more than {max_bytes} bytes")
    if not inflater.eof:
        raise CorruptVersion("payload's compressed stream is truncated")
    return out


def _load(payload: bytes, max_bytes: int = MAX_PAYLOAD_BYTES) -> dict:
    try:
        codec, data = payload[:1], memoryview(payload)[1:]
        if codec not in (b"Z", b"R"):
            raise ValueError(f"unknown codec {bytes(codec)!r}")
        body = msgpack.unpackb(_inflate(data, max_bytes) if codec == b"Z" else data, raw=False)
    except CorruptVersion:
        raise
    except Exception as exc:  # noqa: BLE001  zlib.error, msgpack errors, ...
        raise CorruptVersion(f"payload does not decode ({type(exc).__name__}: {exc})") from exc
    if not isinstance(body, dict) or body.get("v") != FORMAT or body.get("kind") not in ("delta", "snapshot"):
        raise CorruptVersion("payload is not a weight version of a known format")
    if not (isinstance(body.get("version"), int) and isinstance(body.get("hash"), str) and isinstance(body.get("tensors"), list)
            and (body["kind"] == "snapshot" or isinstance(body.get("base_hash"), str))):
        raise CorruptVersion("payload's header is malformed (version, hash, base_hash or tensors)")
    body.setdefault("base", None)
    body.setdefault("base_hash", None)
    return body


def apply_payload(payload: bytes, base: Mapping[str, torch.Tensor] | None = None, *,
                  max_bytes: int = MAX_PAYLOAD_BYTES) -> tuple[int, dict[str, torch.Tensor]]:
    """(version, state) from a snapshot, or from a delta applied to `base`. The result's hash is
    checked against the one the publisher computed: a mismatch raises CorruptVersion. max_bytes
    bounds the decompressed payload and the state it builds."""
    version, state, _, _ = apply_payload_verified(payload, base, max_bytes=max_bytes)
    return version, state


def _shape(value) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(d, int) and 0 <= d < 2**48 for d in value):
        raise ValueError(f"malformed shape {value!r}")
    return tuple(value)


def apply_payload_verified(payload: bytes, base: Mapping[str, torch.Tensor] | None = None, *,
                           max_bytes: int = MAX_PAYLOAD_BYTES) -> tuple[int, dict[str, torch.Tensor], str, str]:
    """(version, state, hash, kind): as apply_payload, also returning the verified hash and the kind."""
    body = _load(payload, max_bytes)
    if body["kind"] == "delta":
        if base is None:
            raise CorruptVersion(f"version {body['version']} is a delta against {body['base']}, and no base was given")
        if state_hash(base) != body["base_hash"]:
            raise CorruptVersion(f"delta to version {body['version']} does not apply to this base (not version {body['base']})")
    state: dict[str, torch.Tensor] = {}
    sparse: list[tuple[np.ndarray, torch.dtype]] = []
    try:
        for entry in body["tensors"]:
            dtype, shape, kind = DTYPES[entry["d"]], _shape(entry["s"]), entry["k"]
            name = entry["n"]
            if not isinstance(name, str):
                raise TypeError(f"tensor name {name!r} is not a string")
            if name in state:
                raise ValueError(f"tensor {name} is listed twice")
            width = torch.empty(0, dtype=dtype).element_size()
            if kind == "dense":
                if not isinstance(entry["b"], bytes):
                    raise TypeError("dense bits are not bytes")
                state[name] = _from_bits(np.frombuffer(entry["b"], dtype=_UINT[width]), dtype, shape)
                continue
            if kind not in ("same", "sparse") or body["kind"] != "delta":
                raise ValueError(f"tensor kind {kind!r} in a {body['kind']}")
            held = base[name]
            if held.dtype != dtype or tuple(held.shape) != shape:
                raise ValueError(f"{name}: the base holds {held.dtype}{tuple(held.shape)}, the entry {dtype}{shape}")
            bits = _bits(held).copy()
            if kind == "sparse":
                sparse.append((bits, dtype))
            state[name] = _from_bits(bits, dtype, shape, copy=False)  # shares `bits`: the sparse changes land in it
        if body["kind"] == "delta":
            _apply_sparse(body, sparse)
    except (KeyError, IndexError, ValueError, RuntimeError, TypeError, OverflowError) as exc:
        raise CorruptVersion(f"version {body['version']} is malformed: {type(exc).__name__}: {exc}") from exc
    if state_hash(state) != body["hash"]:
        raise CorruptVersion(f"version {body['version']} does not match its hash: discarded")
    return body["version"], state, body["hash"], body["kind"]
