"""The parallel, block-by-block encoder writes the bytes of the format as first written: a plain
reference encoder, whatever the pieces, blocks and threads."""

import random

import numpy as np
import pytest
import torch

from swarm.fabric.weights import state_bits, value_classes, varints
from swarm.fabric.weights import delta as wd
from swarm.fabric.weights.delta import CorruptVersion, apply_payload, encode_delta
from tests.helpers.delta_bits import DTYPES, assert_bit_exact, body_of, round_trip


# ---------------------------------------------------------------------------------------------
# the encoder is parallel and works block by block; the bytes it writes must stay those of the
# format as first written. This reference is that first encoder, plainly: one stable sort of each
# piece by class, then every change laid out class by class

def _reference_varints(values) -> bytes:
    out = bytearray()
    for value in np.asarray(values).astype(np.uint64).tolist():
        while value >= 0x80:
            out.append(value & 0x7F | 0x80)
            value >>= 7
        out.append(value)
    return bytes(out)


def _reference_hash(state: dict) -> str:
    import blake3

    h = blake3.blake3()
    for name in sorted(state):
        h.update(f"{name}|{state[name].dtype}|{tuple(state[name].shape)}|".encode())
        h.update(wd._bits(state[name]).tobytes())
    return h.hexdigest()


def reference_delta(base: dict, new: dict, *, base_version: int, version: int, ranges: dict) -> bytes:
    """The delta the format (delta.py's docstring) describes, element by element where it can be, given
    the ranges of exponents the encoder under test picked (its choice: not part of the format)."""
    tensors, pieces, sparse_floats = [], [], set()  # sparse_floats: the changed float dtypes  # pieces of sparse tensors: (first class id, members per class, class ids, ranks, steps)
    for name in sorted(new):
        old_bits, new_bits, dtype = wd._bits(base[name]), wd._bits(new[name]), new[name].dtype
        entry = {"n": name, "d": str(dtype), "s": list(new[name].shape)}
        tensors.append(entry)
        if np.array_equal(old_bits, new_bits):
            entry["k"] = "same"
            continue
        first, count = wd.CLASSES[dtype]
        if count > 1:
            sparse_floats.add(str(dtype))  # (a changed float dtype: its ranges are listed)
        mine, size = [], 0
        for start, end in wd._pieces(old_bits.size):
            old, fresh = old_bits[start:end], new_bits[start:end]
            if count > 1:
                shift, mask = value_classes.EXPONENTS[dtype]
                exponent = (old.astype(np.int64) >> shift) & mask
                local = np.array([sum(exponent_ >= t for t in ranges[str(dtype)]) for exponent_ in exponent.tolist()], np.int64)
            else:
                local = np.zeros(old.size, np.int64)
            order = np.argsort(local, kind="stable")
            members = np.bincount(local, minlength=count)
            sorted_pos = np.flatnonzero((old != fresh)[order])
            index = order[sorted_pos]
            cls = local[index]
            rank = sorted_pos - (np.cumsum(members) - members)[cls]
            is_float = dtype in wd.FLOATS
            steps = varints.zigzag(value_classes.ordered(fresh[index], is_float) - value_classes.ordered(old[index], is_float))
            size += len(_reference_varints(np.diff(sorted_pos, prepend=-1) - 1)) + len(_reference_varints(steps))
            mine.append((first, members, cls + first, rank, steps))
        if size < new_bits.nbytes:
            entry["k"] = "sparse"
            pieces += mine
        else:
            entry.update(k="dense", b=new_bits.tobytes())
    body = {"v": wd.FORMAT, "kind": "delta", "version": version, "base": base_version, "base_hash": _reference_hash(base),
            "hash": _reference_hash(new), "tensors": tensors}
    if sparse_floats:
        body["ranges"] = {d: ranges[d] for d in sorted(sparse_floats)}
    if pieces:
        seen, records = np.zeros(wd.NUM_CLASSES, np.int64), []  # (class, position in the class, step)
        for first, members, cls, rank, steps in pieces:
            records += [(c, int(seen[c]) + r, s) for c, r, s in zip(cls.tolist(), rank.tolist(), steps.tolist())]
            seen[first:first + members.size] += members
        records.sort(key=lambda record: record[0])  # stable: within a class, pieces and ranks ascending
        gaps, last = [], {}
        for c, position, _ in records:
            gaps.append(position - last.get(c, -1) - 1)
            last[c] = position
        ids, counts = np.unique([c for c, _, _ in records], return_counts=True)
        body.update(classes=[[int(c), int(k)] for c, k in zip(ids, counts)], gaps=_reference_varints(gaps),
                    steps=_reference_varints([s for _, _, s in records]))
    return wd.delta_payload(body)


def _random_states(rng: random.Random, seed: int) -> tuple[dict, dict]:
    """Tensors of every dtype and many sizes (empty ones too), a random share of them moved by a few steps."""
    gen = torch.Generator().manual_seed(seed)
    base, new = {}, {}
    for i in range(rng.randrange(1, 8)):
        dtype, n = rng.choice(DTYPES), rng.choice([0, 1, 2, 37, 255, 256, 1000, 4099, 20011])
        if dtype == torch.bool:
            t = torch.rand(n, generator=gen) < 0.5
        elif dtype.is_floating_point:
            t = (torch.randn(n, generator=gen) * 10.0 ** rng.randrange(-8, 3)).to(dtype)
        else:
            t = torch.randint(-100, 100, (n,), generator=gen).to(dtype)
        bits = wd._bits(t).copy()
        hit = np.random.default_rng(seed + i).random(n) < rng.choice([0.0, 0.002, 0.02, 0.2, 0.7, 1.0])
        if dtype == torch.bool:
            bits[hit] ^= 1
        else:
            moves = np.random.default_rng(seed).integers(-3, 4, int(hit.sum()))
            bits[hit] = (bits[hit].astype(np.int64) + moves).astype(bits.dtype)
        shape = (5, n // 5) if n and n % 5 == 0 else (n,)
        base[f"t{i}"] = t.reshape(shape)
        new[f"t{i}"] = torch.from_numpy(bits).view(dtype).reshape(shape) if n else t.clone()
    return base, new


@pytest.mark.parametrize("seed", range(16))
def test_payloads_are_the_reference_encoders_bytes_whatever_the_pieces_blocks_and_threads(seed, monkeypatch):
    rng = random.Random(seed)
    monkeypatch.setattr(state_bits, "CHUNK", rng.choice([37, 1000, 1 << 20]))
    monkeypatch.setattr(value_classes, "RUN", rng.choice([1, 3, 64, 1 << 20]))
    monkeypatch.setattr(state_bits, "THREADS", rng.choice([1, 2, 3]))
    base, new = _random_states(rng, seed)
    payload = encode_delta(base, new, base_version=3, version=4)
    assert payload == reference_delta(base, new, base_version=3, version=4, ranges=body_of(payload).get("ranges", {}))
    _, state = apply_payload(payload, base)
    assert_bit_exact(state, new)


def test_a_bf16_step_over_many_blocks_is_the_reference_encoders_bytes(monkeypatch):
    """A one-ulp RL step on 300K bf16 weights, cut into several pieces, blocks and runs of blocks."""
    monkeypatch.setattr(state_bits, "CHUNK", 100_000)
    monkeypatch.setattr(value_classes, "RUN", 4096)
    gen = torch.Generator().manual_seed(3)
    master = {"w": torch.randn(300_000, generator=gen) * 0.02, "n": torch.ones(999) + torch.randn(999, generator=gen) * 1e-3}
    base = {k: v.to(torch.bfloat16) for k, v in master.items()}
    new = {k: (v + 2e-6 * torch.randn(v.shape, generator=gen).sign()).to(torch.bfloat16) for k, v in master.items()}
    payload = encode_delta(base, new, base_version=0, version=1)
    assert payload == reference_delta(base, new, base_version=0, version=1, ranges=body_of(payload)["ranges"])
    assert body_of(payload)["tensors"][1]["k"] == "sparse"
    for threads in (1, 2):
        monkeypatch.setattr(state_bits, "THREADS", threads)
        _, state = apply_payload(payload, base)
        assert_bit_exact(state, new)


def test_varints_decode_alike_in_runs_on_a_pool_and_narrow(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(4)
    values = np.concatenate([rng.integers(0, 2**7, 300), rng.integers(0, 2**16, 300), rng.integers(0, 2**63, 50, dtype=np.uint64)])
    data = varints.varint_encode(values.astype(np.uint64))
    monkeypatch.setattr(varints, "_DECODE_BYTES", 17)  # many runs, some ending inside a varint (cut back to its start)
    with ThreadPoolExecutor(3) as pool:
        assert np.array_equal(varints.varint_decode(data, max_count=650, pool=pool), values.astype(np.uint64))
        small = varints.varint_encode(values[:600].astype(np.uint64))
        assert np.array_equal(varints.varint_decode(small, max_count=600, dtype=np.uint16, pool=pool), values[:600])
        with pytest.raises(ValueError, match="wider than 16 bits"):
            varints.varint_decode(data, max_count=650, dtype=np.uint16, pool=pool)
        with pytest.raises(ValueError):  # a varint longer than a run, and longer than any number
            varints.varint_decode(b"\x80" * 40 + b"\x01", max_count=5, pool=pool)


@pytest.mark.parametrize("ranges", [None, {}, {"torch.bfloat16": [120, 118, 121]}, {"torch.bfloat16": [1, 2]},
                                    {"torch.bfloat16": [1, 2, 257]}, {"torch.bfloat16": [1, 2, -1]},
                                    {"torch.bfloat16": [1, 2, 3.0]}, {"torch.bfloat16": "x"}, [[1, 2, 3]]])
def test_a_delta_whose_ranges_are_missing_or_malformed_is_refused(ranges):
    """Format 5: a float dtype's ranges of exponents travel in the payload; without them (or with
    thresholds that are not RANGES - 1 non-decreasing exponents) the positions mean nothing."""
    gen = torch.Generator().manual_seed(9)
    master = torch.randn(5000, generator=gen) * 0.02
    base, new = {"w": master.to(torch.bfloat16)}, {"w": (master + 1e-5).to(torch.bfloat16)}
    body = body_of(round_trip(base, new))
    assert set(body["ranges"]) == {"torch.bfloat16"} and len(body["ranges"]["torch.bfloat16"]) == value_classes.RANGES - 1
    if ranges is None:
        del body["ranges"]
    else:
        body["ranges"] = ranges
    with pytest.raises(CorruptVersion, match="malformed"):
        apply_payload(wd.delta_payload(body), base)


def test_ranks_within_ranges_are_those_of_a_stable_sort_by_range():
    """value_classes.ranked (a packed running sum, RUN elements at a time) against the definition: an
    element's rank is its place among its range's members in index order; target_index inverts it."""
    gen = torch.Generator().manual_seed(2)
    old = wd._bits((torch.randn(70_001, generator=gen) * 10.0 ** torch.randint(-9, 2, (70_001,), generator=gen)).to(torch.bfloat16))
    new = old.copy()
    hit = np.random.default_rng(0).random(old.size) < 0.1
    new[hit] += np.uint16(1)
    thresholds = value_classes.pick_thresholds(old, new, torch.bfloat16)
    exponent = (old >> 7) & 0xFF
    local = (exponent[:, None] >= np.array(thresholds)[None, :]).sum(axis=1)
    order = np.argsort(local, kind="stable")
    place = np.empty(old.size, np.int64)
    place[order] = np.arange(old.size)
    members = np.bincount(local, minlength=value_classes.RANGES)
    for run in (1, 1000, 1 << 17):
        value_classes.RUN, saved = run, value_classes.RUN
        try:
            cls, rank, index, counted = value_classes.ranked(old, new, torch.bfloat16, thresholds)
            assert np.array_equal(counted, members)
            assert np.array_equal(index, order[np.isin(order, np.flatnonzero(hit))])
            assert np.array_equal(cls, local[index]) and np.array_equal(rank, place[index] - (np.cumsum(members) - members)[cls])
            assert np.array_equal(value_classes.target_index(old, torch.bfloat16, thresholds, cls, rank), index)
        finally:
            value_classes.RUN = saved
