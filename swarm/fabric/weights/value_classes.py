"""Where a weight delta's changes are counted (format 5; swarm.fabric.weights.delta's format and
speed notes): each element's class, a range of exponents of its dtype (integer dtypes have one
class each), the float bits' order-preserving integer view, the ranges a delta's encoder picks, and
each changed element's rank within its class, found without sorting the elements."""

from __future__ import annotations

import numpy as np
import torch

# Ranges of exponents per float dtype: a delta's positions are counted within each. An element's
# chance of changing is about (update size) / (its ulp), halving with each exponent step; four
# ranges fitted to the data code positions within ~4% of counting per exponent (256 classes, format
# 4), and an element's rank within four ranges is one running sum (see `ranked`).
RANGES = 4
# position classes: (first class id, number of classes) per dtype; floats' exponent fields: (shift, mask)
CLASSES = {torch.bfloat16: (0, RANGES), torch.float32: (RANGES, RANGES), torch.float16: (2 * RANGES, RANGES),
           torch.int64: (3 * RANGES, 1), torch.int32: (3 * RANGES + 1, 1), torch.uint8: (3 * RANGES + 2, 1),
           torch.bool: (3 * RANGES + 3, 1)}
EXPONENTS = {torch.bfloat16: (7, 0xFF), torch.float32: (23, 0xFF), torch.float16: (10, 0x1F)}
NUM_CLASSES = 3 * RANGES + 4
# element width in bits of each class's dtype (a step must fit in it)
CLASS_BITS = np.zeros(NUM_CLASSES, np.int64)
for _dtype, (_first, _count) in CLASSES.items():
    CLASS_BITS[_first:_first + _count] = torch.empty(0, dtype=_dtype).element_size() * 8
# `ranked` counts the members of RANGES - 1 ranges in one int64 running sum, FIELD bits each: it
# works on at most 2^FIELD - 1 elements at a time (speed only: no payload depends on it)
FIELD = 21
RUN = 1 << 17
# one element in this many is sampled when the encoder picks a dtype's ranges (speed only)
SAMPLE_STRIDE = 61


def ordered(bits: np.ndarray, is_float: bool) -> np.ndarray:
    """Float bits -> unsigned integers whose two's-complement reading orders like the floats
    (non-negative: unchanged; negative: the magnitude bits inverted). An involution: applying it
    again gives the bits back. Other dtypes: the bits themselves."""
    if not is_float:
        return bits
    width = bits.dtype.itemsize * 8
    low = bits.dtype.type((1 << (width - 1)) - 1)
    return bits ^ ((bits >> bits.dtype.type(width - 1)) * low)


def exponents(bits: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Each float's exponent field (uint8)."""
    shift, mask = EXPONENTS[dtype]
    out = np.empty(bits.size, np.uint8)
    np.bitwise_and(bits >> bits.dtype.type(shift), bits.dtype.type(mask), out=out, casting="unsafe")
    return out


def check_thresholds(dtype: torch.dtype, thresholds) -> list[int]:
    """A dtype's ranges as a payload gives them: RANGES - 1 non-decreasing exponents (0..the
    largest + 1); range r holds the exponents from threshold r - 1 (0 for r = 0) below threshold r."""
    top = EXPONENTS[dtype][1] + 1
    if not (isinstance(thresholds, list) and len(thresholds) == RANGES - 1 and all(type(t) is int for t in thresholds)
            and all(0 <= a <= b <= top for a, b in zip([0] + thresholds, thresholds + [top]))):
        raise ValueError(f"ranges of {dtype} are not {RANGES - 1} non-decreasing exponents in 0..{top}: {thresholds!r}")
    return thresholds


def _range_table(dtype: torch.dtype, thresholds: list[int]) -> np.ndarray:
    """The range (uint8) of each exponent value."""
    return np.searchsorted(np.array(thresholds), np.arange(EXPONENTS[dtype][1] + 1), side="right").astype(np.uint8)


def _bounds(bits_dtype, dtype: torch.dtype, thresholds: list[int]) -> list:
    """The thresholds as magnitudes (sign bit clear): exponent >= t exactly when magnitude >= t << shift."""
    shift = EXPONENTS[dtype][0]
    return [bits_dtype.type(t << shift) if t << shift < 1 << (bits_dtype.itemsize * 8 - 1) else None for t in thresholds]


def _magnitudes(bits: np.ndarray) -> np.ndarray:
    return bits & bits.dtype.type((1 << (bits.dtype.itemsize * 8 - 1)) - 1)


def members(bits: np.ndarray, dtype: torch.dtype, thresholds: list[int] | None) -> np.ndarray:
    """Members of each of the dtype's classes among `bits` (int64)."""
    count = CLASSES[dtype][1]
    if count == 1:
        return np.array([bits.size], np.int64)
    magnitude = _magnitudes(bits)
    at_least = [bits.size] + [0 if b is None else int(np.count_nonzero(magnitude >= b))
                              for b in _bounds(bits.dtype, dtype, thresholds)] + [0]
    return -np.diff(np.array(at_least, np.int64))


def pick_thresholds(old: np.ndarray, new: np.ndarray, dtype: torch.dtype) -> list[int]:
    """The ranges that code a sample's changes best: the cuts of the exponents into RANGES runs
    minimising the sum over ranges of (members x binary entropy of its share changed), the bits an
    ideal coder of positions within each range would spend (an encoder's choice: not part of the format)."""
    count = EXPONENTS[dtype][1] + 1
    e = exponents(old, dtype)
    return thresholds_from_counts(np.bincount(e, minlength=count), np.bincount(e[old != new], minlength=count))


def thresholds_from_counts(members: np.ndarray, changed: np.ndarray) -> list[int]:
    """pick_thresholds given, per exponent value of the dtype, the sample's members and changed ones."""
    count = members.size
    size = np.concatenate(([0], np.cumsum(members))).astype(np.float64)
    hits = np.concatenate(([0], np.cumsum(changed))).astype(np.float64)
    n = size[None, :] - size[:, None]  # n[i, j]: members of exponents i..j-1
    k = hits[None, :] - hits[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.clip(np.where(n > 0, k / n, 0.0), 1e-12, 1 - 1e-12)
        cost = np.where(n > 0, -n * (p * np.log2(p) + (1 - p) * np.log2(1 - p)), 0.0)
    cost[np.tril_indices(count + 1, -1)] = np.inf  # i > j: no range
    best, cuts = cost[0], []
    for _ in range(RANGES - 1):
        total = best[:, None] + cost  # [i, j]: ranges so far up to i, then one i..j-1
        cuts.append(np.argmin(total, axis=0))
        best = total[cuts[-1], np.arange(count + 1)]
    thresholds, end = [], count
    for cut in reversed(cuts):
        end = int(cut[end])
        thresholds.append(end)
    return thresholds[::-1]


def ranked(old: np.ndarray, new: np.ndarray, dtype: torch.dtype, thresholds: list[int] | None):
    """(class, rank, index) of each element whose bits changed, class by class and rank ascending
    (a rank counts the class's members before the element), and the members of each class.
    Without a sort of the elements: a lookup gives each element a one in its range's FIELD-bit
    field of an int64 (the last range none: its count is what the others leave), and one running
    sum of those counts every range's members before each element at once. RUN elements at a time
    (their temporaries stay in cache and are never paged in afresh)."""
    count = CLASSES[dtype][1]
    if count == 1:
        index = np.flatnonzero(old != new)
        return np.zeros(index.size, np.uint8), index, index, np.array([old.size], np.int64)
    # indexed by sign and exponent (the bits shifted right past the mantissa): no mask to apply
    table = np.tile(_range_table(dtype, thresholds), 2)
    shift = old.dtype.type(EXPONENTS[dtype][0])
    counted = table < RANGES - 1
    shifts = np.where(counted, FIELD * table.astype(np.int64), 0)  # each exponent's field
    ones = np.where(counted, np.int64(1) << shifts, 0)
    field = np.int64((1 << FIELD) - 1)
    seen = np.zeros(RANGES, np.int64)  # members of each range before the run
    running = np.empty(min(RUN, old.size), np.int64)
    parts = []
    for start in range(0, old.size, RUN):
        end = min(start + RUN, old.size)
        at = np.flatnonzero(old[start:end] != new[start:end])
        e = old[start:end] >> shift
        mine = running[:e.size]
        np.take(ones, e, out=mine, mode="clip")  # (mode="raise" with out= buffers the whole result)
        np.cumsum(mine, out=mine)
        e_at = e[at]
        got = table[e_at]
        before = mine[at] - ones[e_at]  # the changed elements' ranges' members before them, in the run
        place = (before >> shifts[e_at]) & field
        last = np.flatnonzero(got == RANGES - 1)
        if last.size:  # the uncounted range: the elements before, less the counted ranges' members
            counts = before[last]
            place[last] = at[last] - sum((counts >> np.int64(FIELD * r)) & field for r in range(RANGES - 1))
        place += seen[got]
        parts.append((got, place, at + start))
        total = int(mine[-1])
        counts = [(total >> (FIELD * r)) & ((1 << FIELD) - 1) for r in range(RANGES - 1)]
        seen += np.array(counts + [e.size - sum(counts)], np.int64)
    if not parts:
        return np.zeros(0, np.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64), seen
    cls, rank, index = (np.concatenate(p) for p in zip(*parts))
    order = np.argsort(cls, kind="stable")
    return cls[order], rank[order], index[order], seen


def target_index(base: np.ndarray, dtype: torch.dtype, thresholds: list[int] | None, cls: np.ndarray,
                 rank: np.ndarray) -> np.ndarray:
    """The index in a piece of each (class, rank) target, targets class by class and rank ascending:
    run by run (RUN elements), the members of each class with targets there, listed in index order,
    taken at the ranks that fall in the run."""
    if CLASSES[dtype][1] == 1:
        return rank
    bounds = _bounds(base.dtype, dtype, thresholds)
    classes, firsts = np.unique(cls, return_index=True)
    lasts = np.append(firsts[1:], cls.size)
    spans = []  # per class with targets: (class, its targets' ranks, where they go in `index`, the magnitudes it spans)
    for c, s, e in zip(classes.tolist(), firsts.tolist(), lasts.tolist()):
        lo = None if c == 0 else bounds[c - 1]
        hi = None if c == RANGES - 1 else bounds[c]
        if lo is None and c > 0:  # the range starts past every magnitude: no member (the ranks were checked)
            raise ValueError("a change in an empty range")
        spans.append((rank[s:e], s, lo, hi))
    index = np.empty(rank.size, np.int64)
    done = [0] * len(spans)  # targets placed so far, per class
    seen = [0] * len(spans)  # members counted so far, per class
    for start in range(0, base.size, RUN):
        magnitude = _magnitudes(base[start:start + RUN])
        for j, (ranks, s, lo, hi) in enumerate(spans):
            if done[j] == ranks.size:
                continue
            if lo is None and hi is None:
                mask = None
            elif hi is None:
                mask = magnitude >= lo
            elif lo is None:
                mask = magnitude < hi
            else:
                mask = (magnitude >= lo) & (magnitude < hi)
            listed = None if mask is None else np.flatnonzero(mask)  # (its size: the members, counted once)
            members = magnitude.size if mask is None else listed.size
            upto = done[j] + int(np.searchsorted(ranks[done[j]:], seen[j] + members))
            if upto > done[j]:
                where = ranks[done[j]:upto] - seen[j]
                index[s + done[j]:s + upto] = start + (where if mask is None else listed[where])
            done[j], seen[j] = upto, seen[j] + members
    if any(d != ranks.size for d, (ranks, _, _, _) in zip(done, spans)):
        raise ValueError("a change ranked past its class's members")
    return index
