"""Compiled loops of the weight-delta codec (format 5; swarm.fabric.weights.delta describes it): one
pass over a piece's elements where the numpy path (value_classes.ranked, target_index) makes
several over arrays of temporaries. numba compiles them on first use (`cache=True`: once per
machine, the result kept in __pycache__) and they release the GIL, so the codec's pool threads run
them side by side. Importing this module imports no numba: numba and llvmlite take 0.35 CPU s to
import on the 2-core machine, paid by every process that imports the codec (a bootstrap node, the
CLI's `status`) though only the ones that encode or apply a version use it. The first call of any
kernel imports numba and makes every kernel a compiled one (_compile_all).

Without numba (it is a dependency, but a peer must still run without it) ENABLED is False and the
codec takes its numpy path, which writes the same bytes and builds the same states
(tests/fabric/weights/test_delta_kernels.py compares the two).

Arithmetic: every element is widened to uint64 and every constant is a np.uint64 (numba reads
uint64 mixed with a signed integer as float64); results are cut back to the element's width."""

from __future__ import annotations

import functools
import importlib.util
import sys
import threading

import numpy as np


def _numba_installed() -> bool:
    if "numba" in sys.modules:  # (None there: an import that is to fail, as a test sets it)
        return sys.modules["numba"] is not None
    return importlib.util.find_spec("numba") is not None


ENABLED = _numba_installed()
# elements counted in one int64 of four 16-bit fields (one per class) before it is added to the
# piece's counts: a field never exceeds 0xFFFE, so 0xFFFF marks "no target in this block"
BLOCK = 0xFFFF
_NONE = np.int64(0xFFFF)


# kernels not compiled yet, by name: each module-level name stands for its first call until then
_PENDING: dict = {}
_COMPILING = threading.Lock()


def _compile_all() -> None:
    """Every kernel as numba's dispatcher under its module-level name, all at once: a kernel that
    calls another (_varint, _ordered) finds the other compiled when numba resolves its globals."""
    with _COMPILING:
        if not _PENDING:
            return
        import numba

        # (one update, under the GIL: a thread that takes a kernel by its module name meanwhile
        # never gets a compiled one whose callee is still a stand-in)
        globals().update({name: numba.njit(nogil=True, cache=True)(fn) for name, fn in _PENDING.items()})
        _PENDING.clear()


def _compiled(fn):
    """`fn` compiled at its first call (without numba: `fn` itself, for the numpy path's tests)."""
    if not ENABLED:
        return fn
    _PENDING[fn.__name__] = fn

    @functools.wraps(fn)
    def first_call(*args):
        _compile_all()
        return globals()[fn.__name__](*args)

    return first_call


def class_bounds(dtype_bits, thresholds: list[int] | None, shift: int | None) -> np.ndarray:
    """A piece's class test as three magnitudes of the bits' dtype, then the magnitude mask: an
    element of magnitude m (sign bit clear) is in class (m >= b0) + (m >= b1) + (m >= b2), which is
    value_classes' range of its exponent (exponent >= t exactly when m >= t << shift). A threshold
    past every exponent becomes 1 << (width - 1), above every magnitude. Integer dtypes (one class):
    mask 0 and bounds 1, so every element is in class 0."""
    if thresholds is None:
        return np.array([1, 1, 1, 0], dtype_bits)
    cap = 1 << (np.dtype(dtype_bits).itemsize * 8 - 1)
    return np.array([min(t << shift, cap) for t in thresholds] + [cap - 1], dtype_bits)


@_compiled
def _ordered(b, is_float, top):
    """value_classes.ordered on one element widened to uint64 (`top`: its sign bit's place)."""
    if is_float:
        return b ^ ((b >> top) * ((np.uint64(1) << top) - np.uint64(1)))
    return b


@_compiled
def _varint(out, at, v):
    """v (uint64) as a LEB128 varint at out[at:]; returns where the next one goes."""
    while v >= np.uint64(0x80):
        out[at] = np.uint8((v & np.uint64(0x7F)) | np.uint64(0x80))
        v >>= np.uint64(7)
        at += 1
    out[at] = np.uint8(v)
    return at + 1


@_compiled
def _varint_size(v):
    size = 1
    while v >= np.uint64(0x80):
        v >>= np.uint64(7)
        size += 1
    return size


@_compiled
def ranked_changes(old, new, bounds, is_float):
    """value_classes.ranked and the steps of delta._piece_changes in one pass: (members of each of
    the 4 classes, then per change in index order its class (uint8), rank within its class, zigzag
    step (uint64)). Block by block: the first loop counts every class in one packed int64 and notes
    where each change is and the counts before it; the second ranks and steps the changes."""
    n = old.size
    top = np.uint64(old.itemsize * 8 - 1)
    mask = (np.uint64(1) << top) - np.uint64(1) + (np.uint64(1) << top)  # the width's ones
    b0, b1, b2, low = bounds[0], bounds[1], bounds[2], bounds[3]
    counts = np.zeros(4, np.int64)
    cls = np.empty(n, np.uint8)
    rank = np.empty(n, np.int64)
    steps = np.empty(n, np.uint64)
    at = np.empty(min(n, BLOCK) + 1, np.int64)
    before = np.empty(min(n, BLOCK) + 1, np.int64)
    total = 0
    for start in range(0, n, BLOCK):
        end = min(start + BLOCK, n)
        packed = np.int64(0)
        k = 0
        for i in range(start, end):
            o = old[i]
            m = o & low
            c = np.int64(m >= b0) + np.int64(m >= b1) + np.int64(m >= b2)
            if o != new[i]:  # (a branch: cheaper than two stores an element at a few percent changed)
                at[k] = i
                before[k] = packed
                k += 1
            packed += np.int64(1) << (c << 4)
        for j in range(k):
            i = at[j]
            o = old[i]
            m = o & low
            c = np.int64(m >= b0) + np.int64(m >= b1) + np.int64(m >= b2)
            cls[total] = c
            rank[total] = counts[c] + ((before[j] >> (c << 4)) & 0xFFFF)
            d = (_ordered(np.uint64(new[i]), is_float, top) - _ordered(np.uint64(o), is_float, top)) & mask
            steps[total] = ((d << np.uint64(1)) ^ ((d >> top) * mask)) & mask
            total += 1
        for c in range(4):
            counts[c] += (packed >> (c << 4)) & 0xFFFF
    return counts, cls[:total], rank[:total], steps[:total]


@_compiled
def class_streams(cls, rank, steps, classes):
    """A piece's changes (ranked_changes') laid out class by class as delta._piece_changes lays them
    out: per class (of `classes`) its changes, their rank of its first and last change, and the
    varint bytes of its gaps (the first one a 0 placeholder) and of its steps, with where each
    class's bytes end. Two passes over the changes in index order (within a class, ranks ascend):
    each class's byte counts, then the bytes, each class written from its own cursor."""
    changed = np.zeros(classes, np.int64)
    firsts = np.zeros(classes, np.int64)
    lasts = np.full(classes, -1, np.int64)
    gap_ends = np.zeros(classes, np.int64)
    step_ends = np.zeros(classes, np.int64)
    for j in range(cls.size):
        c = cls[j]
        if lasts[c] < 0:
            firsts[c] = rank[j]
            gap_ends[c] += 1  # the placeholder: the gap from the class's earlier pieces is written when the piece is added
        else:
            gap_ends[c] += _varint_size(np.uint64(rank[j] - lasts[c] - 1))
        step_ends[c] += _varint_size(steps[j])
        lasts[c] = rank[j]
        changed[c] += 1
    for c in range(1, classes):
        gap_ends[c] += gap_ends[c - 1]
        step_ends[c] += step_ends[c - 1]
    gaps = np.empty(gap_ends[classes - 1], np.uint8)
    out = np.empty(step_ends[classes - 1], np.uint8)
    g = np.zeros(classes, np.int64)  # each class's cursors: where its bytes start
    s = np.zeros(classes, np.int64)
    for c in range(1, classes):
        g[c] = gap_ends[c - 1]
        s[c] = step_ends[c - 1]
    last = np.full(classes, -1, np.int64)
    for j in range(cls.size):
        c = cls[j]
        if last[c] < 0:
            gaps[g[c]] = 0
            g[c] += 1
        else:
            g[c] = _varint(gaps, g[c], np.uint64(rank[j] - last[c] - 1))
        s[c] = _varint(out, s[c], steps[j])
        last[c] = rank[j]
    return changed, firsts, np.maximum(lasts, 0), gaps, gap_ends, out, step_ends


@_compiled
def class_members(bits, bounds):
    """Members of each of the 4 classes among `bits` (value_classes.members)."""
    b0, b1, b2, low = bounds[0], bounds[1], bounds[2], bounds[3]
    a0 = 0
    a1 = 0
    a2 = 0
    for i in range(bits.size):
        m = bits[i] & low
        a0 += np.int64(m >= b0)
        a1 += np.int64(m >= b1)
        a2 += np.int64(m >= b2)
    counts = np.empty(4, np.int64)
    counts[0] = bits.size - a0
    counts[1] = a0 - a1
    counts[2] = a1 - a2
    counts[3] = a2
    return counts


@_compiled
def _stepped(b, z, is_float, top, mask):
    """An element's bits (uint64) moved by a zigzag step z, in its width."""
    step = (z >> np.uint64(1)) ^ ((np.uint64(0) - (z & np.uint64(1))) & mask)
    return _ordered((_ordered(b, is_float, top) + step) & mask, is_float, top)


@_compiled
def apply_changes(out, base, bounds, is_float, cls, lo, hi, before, positions, steps):
    """delta._apply_piece: out = base with the changes lo[j]..hi[j] of the streams applied, class
    cls[j] (members of it in earlier pieces: before[j]), in one pass that copies each element and
    counts its class's members up to it. Returns False when a change is ranked past its class's
    members in the piece (the caller raises)."""
    n = base.size
    top = np.uint64(base.itemsize * 8 - 1)
    mask = (np.uint64(1) << top) - np.uint64(1) + (np.uint64(1) << top)
    b0, b1, b2, low = bounds[0], bounds[1], bounds[2], bounds[3]
    nxt = np.zeros(4, np.int64)  # the next change of each class: its place in the streams
    end = np.zeros(4, np.int64)
    offset = np.zeros(4, np.int64)  # the class's members before this block (earlier pieces' included)
    for j in range(cls.size):
        nxt[cls[j]] = lo[j]
        end[cls[j]] = hi[j]
        offset[cls[j]] = before[j]
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        # each class's next target as its rank within the block, 16 bits a class (0xFFFF: none here)
        targets = np.int64(0)
        for c in range(4):
            t = _NONE
            if nxt[c] < end[c]:
                r = np.int64(positions[nxt[c]]) - offset[c]
                if 0 <= r < stop - start:  # (below 0: not ascending; never placed, so refused at the end)
                    t = r
            targets |= t << (c << 4)
        packed = np.int64(0)
        for i in range(start, stop):
            x = base[i]
            out[i] = x
            m = x & low
            sh = (np.int64(m >= b0) + np.int64(m >= b1) + np.int64(m >= b2)) << 4
            if ((packed ^ targets) >> sh) & 0xFFFF == 0:
                c = sh >> 4
                out[i] = _stepped(np.uint64(x), np.uint64(steps[nxt[c]]), is_float, top, mask)
                nxt[c] += 1
                t = _NONE
                if nxt[c] < end[c]:
                    r = np.int64(positions[nxt[c]]) - offset[c]
                    if 0 <= r < stop - start:
                        t = r
                targets = (targets & ~(np.int64(0xFFFF) << sh)) | (t << sh)
            packed += np.int64(1) << sh
        for c in range(4):
            offset[c] += (packed >> (c << 4)) & 0xFFFF
    for c in range(4):
        if nxt[c] < end[c]:
            return False
    return True


@_compiled
def sample_exponents(old, new, shift, mask, stride, members, changed):
    """Adds to members[e] and changed[e] the elements old[::stride] of exponent e, and of those the
    ones whose bits changed (value_classes.pick_thresholds' sample, counted without copying it)."""
    for i in range(0, old.size, stride):
        e = (np.uint64(old[i]) >> np.uint64(shift)) & np.uint64(mask)
        members[e] += 1
        changed[e] += np.int64(old[i] != new[i])


@_compiled
def equal(a, b):
    """Whether two arrays of bits are equal (stops at the first difference; no temporaries)."""
    if a.size != b.size:
        return False
    for i in range(a.size):
        if a[i] != b[i]:
            return False
    return True


@_compiled
def undo_streams(newer, older, is_float):
    """undo._encode_tensor's two varint streams in two passes over the bits (the numpy path builds a
    boolean array the size of the tensor, its changed indices, and temporaries of every change):
    (the number of changed elements, the varints of the gaps between them, the varints of each one's
    zigzag step from `newer` back to `older`)."""
    n = newer.size
    count = 0
    for i in range(n):
        if newer[i] != older[i]:
            count += 1
    top = np.uint64(newer.itemsize * 8 - 1)
    mask = (np.uint64(1) << top) - np.uint64(1) + (np.uint64(1) << top)  # the width's ones
    gaps = np.empty(count * 10, np.uint8)  # (a uint64 varint is at most 10 bytes)
    steps = np.empty(count * ((newer.itemsize * 8 + 6) // 7), np.uint8)  # (a step is as wide as its element)
    g, s, last = 0, 0, -1
    for i in range(n):
        if newer[i] != older[i]:
            g = _varint(gaps, g, np.uint64(i - last - 1))
            last = i
            d = (_ordered(np.uint64(older[i]), is_float, top) - _ordered(np.uint64(newer[i]), is_float, top)) & mask
            s = _varint(steps, s, ((d << np.uint64(1)) ^ ((d >> top) * mask)) & mask)
    return count, gaps[:g], steps[:s]


# decode_varints' answers other than a count: what was wrong with the data
VARINT_TOO_LONG, VARINT_OVER_64_BITS, VARINT_TOO_WIDE = -1, -2, -3


@_compiled
def decode_varints(buf, out, max_bytes, limit_bits):
    """varints._decode_varints in one pass: the LEB128 varints of `buf` (ending with a last byte)
    into the start of `out`, how many; or VARINT_TOO_LONG (one of more than `max_bytes` bytes),
    VARINT_OVER_64_BITS, VARINT_TOO_WIDE (a number at or past 2^limit_bits). The numpy path takes
    five passes and temporaries for every number (a third of a sampler's apply on a dense delta)."""
    n = 0
    value = np.uint64(0)
    length = 0
    for i in range(buf.size):
        byte = np.uint64(buf[i])
        if length == 9 and byte > np.uint64(1):
            return VARINT_OVER_64_BITS
        value |= (byte & np.uint64(0x7F)) << np.uint64(7 * length)
        length += 1
        if byte < np.uint64(0x80):
            if limit_bits < 64 and (value >> np.uint64(limit_bits)) != np.uint64(0):
                return VARINT_TOO_WIDE
            out[n] = value
            n += 1
            value = np.uint64(0)
            length = 0
        elif length >= max_bytes:
            return VARINT_TOO_LONG
    return n
