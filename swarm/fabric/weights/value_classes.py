"""Where a weight delta's changes are counted: each element's class (one exponent value of one
dtype; integer dtypes have one class each), the float bits' order-preserving integer view, and a
piece's classes counted block by block (swarm.fabric.weights.delta's format and speed notes)."""

from __future__ import annotations

import numpy as np
import torch

# position classes: (first class id, number of classes, shift of the exponent field, its mask) per dtype
CLASSES = {torch.bfloat16: (0, 256, 7, 0xFF), torch.float32: (256, 256, 23, 0xFF), torch.float16: (512, 32, 10, 0x1F),
           torch.int64: (544, 1, 0, 0), torch.int32: (545, 1, 0, 0), torch.uint8: (546, 1, 0, 0), torch.bool: (547, 1, 0, 0)}
NUM_CLASSES = 548
# element width in bits of each class's dtype (a step must fit in it)
CLASS_BITS = np.zeros(NUM_CLASSES, np.int64)
for _dtype, (_first, _count, _, _) in CLASSES.items():
    CLASS_BITS[_first:_first + _count] = torch.empty(0, dtype=_dtype).element_size() * 8
# classes are sorted this many elements at a time: a stable argsort of 64K one-byte keys (a radix
# sort) stays in cache, and runs two to three times faster per element than one of a whole piece
BLOCK = 1 << 16
# a thread sorts this many elements at once (its working memory: about 16 bytes an element of it)
GROUP = 1 << 18


def ordered(bits: np.ndarray, is_float: bool) -> np.ndarray:
    """Float bits -> unsigned integers whose two's-complement reading orders like the floats
    (non-negative: unchanged; negative: the magnitude bits inverted). An involution: applying it
    again gives the bits back. Other dtypes: the bits themselves."""
    if not is_float:
        return bits
    width = bits.dtype.itemsize * 8
    low = bits.dtype.type((1 << (width - 1)) - 1)
    return bits ^ ((bits >> bits.dtype.type(width - 1)) * low)


def local_classes(bits: np.ndarray, dtype: torch.dtype) -> np.ndarray | None:
    """Each element's class within its dtype (the exponent field, uint8), or None for dtypes with
    one class."""
    _, count, shift, mask = CLASSES[dtype]
    if count == 1:
        return None
    return ((bits >> bits.dtype.type(shift)) & bits.dtype.type(mask)).astype(np.uint8)


def block_size(n: int) -> int:
    return max(1, min(BLOCK, n))


def groups(n: int, block: int) -> list[tuple[int, int]]:
    """The runs of whole blocks (GROUP elements or so) a piece of n elements is worked on in."""
    step = block * max(1, GROUP // block)
    return [(start, min(start + step, n)) for start in range(0, n, step)]


def block_classes(bits: np.ndarray, dtype: torch.dtype, block: int) -> np.ndarray:
    """The elements' classes (uint8), padded to whole blocks with the dtype's last class: padding
    sorts after every element of its block, so it moves none of them."""
    _, count, shift, mask = CLASSES[dtype]
    classes = np.empty(-(-bits.size // block) * block, np.uint8)
    classes[bits.size:] = count - 1
    np.bitwise_and(bits >> bits.dtype.type(shift), bits.dtype.type(mask), out=classes[:bits.size], casting="unsafe")
    return classes


def block_starts(sorted_classes: np.ndarray, count: int, block: int) -> np.ndarray:
    """Where each class starts in each of a run's blocks, whose classes are sorted (flat positions,
    block by block and class by class, then the run's end)."""
    rows = sorted_classes.size // block
    keys = np.arange(count, dtype=np.uint8)
    starts = np.empty(rows * count + 1, np.int64)
    for r in range(rows):
        starts[r * count:(r + 1) * count] = r * block + np.searchsorted(sorted_classes[r * block:(r + 1) * block], keys)
    starts[-1] = rows * block
    return starts


def block_members(bits: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Members of each class in each block of a piece (blocks x classes, int64)."""
    _, count, _, _ = CLASSES[dtype]
    if count == 1:
        return np.array([[bits.size]], np.int64)
    block = block_size(bits.size)
    members = np.zeros((-(-bits.size // block), count), np.int64)
    for start, end in groups(bits.size, block):
        classes = np.sort(block_classes(bits[start:end], dtype, block).reshape(-1, block), axis=1, kind="stable")
        rows = np.diff(block_starts(classes.ravel(), count, block)).reshape(-1, count)
        members[start // block:start // block + rows.shape[0]] = rows
    if bits.size:
        members[-1, -1] -= members.size // count * block - bits.size  # the padding
    return members


def target_index(base: np.ndarray, dtype: torch.dtype, members: np.ndarray, cls: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """The index in a piece of each (class, rank) target, targets class by class and rank ascending,
    given the members of each class in each of the piece's blocks."""
    _, count, _, _ = CLASSES[dtype]
    if count == 1:
        return rank
    n = base.size
    block = block_size(n)
    rows = members.shape[0]
    before = np.cumsum(members, axis=0) - members  # of each class in earlier blocks
    # A target's block is the last whose earlier members of its class are at most its rank. Laid out
    # class by class (each class offset past the previous one's ranks), the targets and the blocks'
    # starts are both ascending: counting the targets below each start places them all, in O(targets).
    starts = (before.T + np.arange(count)[:, None] * (n + 1)).ravel()
    targets = cls.astype(np.int64) * (n + 1) + rank
    per_block = np.diff(np.searchsorted(targets, starts), append=targets.size)  # (class, block), class by class
    del targets
    # each target's place in the piece sorted block by block, then class by class within a block
    first_place = (np.cumsum(members, axis=1) - members - before + np.arange(rows)[:, None] * block).T.ravel()
    place = np.repeat(first_place, per_block) + rank
    row = place // block
    if rows * block <= GROUP:  # one run of blocks
        order = np.argsort(block_classes(base, dtype, block).reshape(-1, block), axis=1, kind="stable")
        return row * block + order.ravel()[place]
    by_row = np.argsort(row.astype(np.uint16) if rows <= 1 << 16 else row, kind="stable")
    sorted_rows = row[by_row]
    index = np.empty(rank.size, np.int64)
    for start, end in groups(n, block):  # sort the blocks a run at a time, as the encoder did
        lo, hi = np.searchsorted(sorted_rows, [start // block, -(-end // block)])
        if lo < hi:
            mine = by_row[lo:hi]
            order = np.argsort(block_classes(base[start:end], dtype, block).reshape(-1, block), axis=1, kind="stable")
            index[mine] = row[mine] * block + order.ravel()[place[mine] - start]
    return index
