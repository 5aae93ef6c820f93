"""Weight versions: deltas reconstruct published bf16 weights bit for bit, chains of deltas,
snapshots for late joiners, and corrupt or misapplied payloads are detected."""

import pytest
import torch

from swarm.fabric.weights.delta import CorruptVersion, apply_payload, encode_delta, encode_snapshot, payload_header, state_hash


def published(model) -> dict:
    """What a learner publishes: its fp32 master weights cast to the samplers' dtype."""
    return {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}


def train_versions(n: int, lr: float = 1e-5):  # RL learning rates for LLMs: 1e-6..1e-5
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    versions = [published(model)]
    for _ in range(n):
        loss = model(torch.randn(16, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        versions.append(published(model))
    return versions


def test_chain_of_deltas_reconstructs_every_version_bit_for_bit():
    versions = train_versions(10)
    payloads = [encode_delta(versions[i], versions[i + 1], base_version=i, version=i + 1) for i in range(10)]
    snapshot = encode_snapshot(versions[0], 0)
    version, state = apply_payload(snapshot)
    assert version == 0
    for i, payload in enumerate(payloads):
        version, state = apply_payload(payload, state)
        assert version == i + 1
        assert state_hash(state) == state_hash(versions[i + 1])
        assert all(torch.equal(state[k].view(torch.int16), versions[i + 1][k].view(torch.int16)) for k in state)
    # at an RL-like learning rate a bf16 version differs in few elements: the delta is much smaller
    assert max(len(p) for p in payloads) < 0.3 * len(snapshot)


def test_a_late_joiner_starts_from_a_snapshot_of_any_version():
    versions = train_versions(3)
    version, state = apply_payload(encode_snapshot(versions[3], 3))
    assert version == 3 and state_hash(state) == state_hash(versions[3])


def test_unchanged_and_fully_changed_tensors():
    a = {"w": torch.zeros(100, dtype=torch.bfloat16), "x": torch.ones(4)}
    b = {"w": torch.arange(100, dtype=torch.bfloat16), "x": torch.ones(4)}
    _, state = apply_payload(encode_delta(a, b, base_version=0, version=1), a)
    assert torch.equal(state["w"], b["w"]) and torch.equal(state["x"], b["x"])


def test_tampered_payload_is_detected():
    versions = train_versions(2)
    payload = bytearray(encode_delta(versions[0], versions[1], base_version=0, version=1))
    payload[len(payload) // 2] ^= 0xFF
    with pytest.raises(CorruptVersion):
        apply_payload(bytes(payload), versions[0])
    with pytest.raises(CorruptVersion, match="does not decode"):
        apply_payload(b"not a payload")


def test_delta_applied_to_the_wrong_base_is_refused():
    versions = train_versions(3)
    delta = encode_delta(versions[1], versions[2], base_version=1, version=2)
    assert payload_header(delta)["base"] == 1
    with pytest.raises(CorruptVersion, match="does not apply to this base"):
        apply_payload(delta, versions[0])
    with pytest.raises(CorruptVersion, match="no base was given"):
        apply_payload(delta)


def test_mismatched_versions_cannot_be_delta_encoded():
    with pytest.raises(ValueError, match="tensor names differ"):
        encode_delta({"a": torch.zeros(2)}, {"b": torch.zeros(2)}, base_version=0, version=1)
    with pytest.raises(ValueError, match="send a snapshot"):
        encode_delta({"a": torch.zeros(2)}, {"a": torch.zeros(3)}, base_version=0, version=1)


# ---------------------------------------------------------------------------------------------
# format 3: positions class by class (the base's exponent), steps in representable values

import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.fabric.weights import state_bits, value_classes, varints
from swarm.fabric.weights import delta as wd

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool]
WIDTH = {torch.float32: 32, torch.bfloat16: 16, torch.float16: 16, torch.int64: 64, torch.int32: 32, torch.uint8: 8,
         torch.bool: 8}


def body_of(payload: bytes) -> dict:
    assert payload[:1] == wd.DELTA_CODEC
    return wd.delta_body(payload)


def from_bits(values, dtype) -> torch.Tensor:
    """A tensor of `dtype` holding exactly these bit patterns."""
    width = torch.empty(0, dtype=dtype).element_size()
    return torch.from_numpy(np.array(values, dtype=np.uint64).astype(wd._UINT[width])).view(dtype).clone()


def assert_bit_exact(state: dict, expected: dict) -> None:
    assert set(state) == set(expected)
    for name, t in expected.items():
        assert state[name].dtype == t.dtype and state[name].shape == t.shape, name
        assert np.array_equal(wd._bits(state[name]), wd._bits(t)), name


def round_trip(base: dict, new: dict) -> bytes:
    payload = encode_delta(base, new, base_version=0, version=1)
    version, state = apply_payload(payload, base)
    assert version == 1
    assert_bit_exact(state, new)
    return payload


def signed_steps(payload: bytes) -> list[int]:
    """The steps a payload carries, in its order, as signed integers."""
    z = varints.varint_decode(body_of(payload).get("steps", b""), max_count=10**9)
    return [(int(v) >> 1) ^ -(int(v) & 1) for v in z]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ordered_bits_sort_like_the_floats_they_are(dtype):
    """Every non-NaN bit pattern of a 16-bit float (a sample for float32): the ordered integers
    rise with the value, -0.0 just below +0.0, one apart between neighbours."""
    width = WIDTH[dtype]
    if width == 16:
        patterns = np.arange(2**16, dtype=np.uint16)
    else:
        patterns = np.unique(np.concatenate([np.random.default_rng(0).integers(0, 2**32, 200_000, dtype=np.uint64),
                                             [0, 1, 2**31, 2**31 + 1, 0x7F7FFFFF, 0x7F800000, 0xFF800000]]).astype(np.uint32))
    with np.errstate(invalid="ignore"):
        values = torch.from_numpy(patterns.copy()).view(dtype).float().numpy().astype(np.float64)
    keep = ~np.isnan(values)
    patterns, values = patterns[keep], values[keep]
    signed = value_classes.ordered(patterns, True).view(wd._INT[width // 8]).astype(np.int64)
    by_value = np.lexsort((np.signbit(values) == 0, values))  # -0.0 before +0.0
    assert np.all(np.diff(signed[by_value]) > 0)
    if width == 16:
        assert np.all(np.diff(signed[by_value]) == 1)  # NaNs excluded, neighbours are one step apart
    assert np.array_equal(value_classes.ordered(value_classes.ordered(patterns, True), True), patterns)  # an involution


@pytest.mark.parametrize("dtype,moves", [
    # (old bits, new bits, steps): one ulp across zero, across exponent boundaries, to infinity
    (torch.bfloat16, [(0x0000, 0x8000, -1), (0x8000, 0x0000, 1), (0x0001, 0x8001, -3), (0x8001, 0x0000, 2),
                      (0x3F7F, 0x3F80, 1), (0x3F80, 0x3F7F, -1), (0xBF80, 0xBF7F, 1), (0xBF7F, 0xBF80, -1),
                      (0x007F, 0x0080, 1), (0x7F7F, 0x7F80, 1), (0xFF7F, 0xFF80, -1), (0x3C00, 0x3C01, 1)]),
    (torch.float16, [(0x0000, 0x8000, -1), (0x3BFF, 0x3C00, 1), (0xBC00, 0xBBFF, 1), (0x7BFF, 0x7C00, 1),
                     (0x03FF, 0x0400, 1), (0x8001, 0x0001, 3)]),
    (torch.float32, [(0x00000000, 0x80000000, -1), (0x3F7FFFFF, 0x3F800000, 1), (0xBF800000, 0xBF7FFFFF, 1),
                     (0x7F7FFFFF, 0x7F800000, 1), (0x80000001, 0x00000001, 3)]),
])
def test_steps_are_counted_in_representable_values(dtype, moves):
    n = 64
    base_bits = [0x3E00 if WIDTH[dtype] == 16 else 0x3E000000] * n  # unchanged filler
    new_bits = list(base_bits)
    for i, (old, new, _) in enumerate(moves):
        base_bits[3 * i], new_bits[3 * i] = old, new
    payload = round_trip({"w": from_bits(base_bits, dtype)}, {"w": from_bits(new_bits, dtype)})
    assert [e["k"] for e in body_of(payload)["tensors"]] == ["sparse"]
    assert sorted(signed_steps(payload)) == sorted(step for _, _, step in moves)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nan_and_infinity_bit_patterns_round_trip(dtype):
    if WIDTH[dtype] == 16:
        exp = 0x7F80 if dtype == torch.bfloat16 else 0x7C00
        specials = [exp, exp | 0x8000, exp | 1, exp | 0x40, 0xFFFF, 0x7FFF, exp | 0x8001, 0x0000, 0x8000, 0x0001]
    else:
        exp = 0x7F800000
        specials = [exp, exp | 0x80000000, exp | 1, 0x7FC00000, 0xFFFFFFFF, 0x7FFFFFFF, 0xFFC00001, 0, 0x80000000, 1]
    # every special turned into every other one (and back), plus finite values turned into specials
    pairs = [(a, b) for a in specials for b in specials if a != b]
    finite = 0x3F80 if WIDTH[dtype] == 16 else 0x3F800000
    pairs += [(finite, s) for s in specials] + [(s, finite) for s in specials]
    base = {"w": from_bits([a for a, _ in pairs] * 3, dtype)}
    new = {"w": from_bits([b for _, b in pairs] + [a for a, _ in pairs] * 2, dtype)}
    round_trip(base, new)
    round_trip(new, base)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_round_trips_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(1)
    n = 3000
    if dtype == torch.bool:
        a = torch.rand(n, generator=gen) < 0.5
    elif dtype.is_floating_point:
        a = (torch.randn(n, generator=gen) * 0.02).to(dtype)
    else:
        info = torch.iinfo(dtype)
        a = torch.randint(info.min, info.max, (n,), generator=gen, dtype=dtype)
    bits = wd._bits(a).copy()
    few = bits.copy()
    idx = np.array([0, 1, 2, 77, 1500, n - 2, n - 1])
    few[idx] += bits.dtype.type(1)  # one step (wraps at the top of an integer range)
    few[[5, 6]] -= bits.dtype.type(1)
    few[[9, 10]] = np.array([0, np.iinfo(bits.dtype).max], bits.dtype)  # the extremes
    if dtype == torch.bool:
        few = bits.copy()
        few[idx] ^= 1
    small = {"t": torch.from_numpy(few).view(dtype), "same": a.clone()}
    payload = round_trip({"t": a, "same": a.clone()}, small)
    assert {e["n"]: e["k"] for e in body_of(payload)["tensors"]} == {"same": "same", "t": "sparse"}
    # everything replaced by unrelated bits: the tensor goes dense
    rnd = np.random.default_rng(2).integers(0, 2 if dtype == torch.bool else 2**63, n, dtype=np.uint64)
    other = torch.from_numpy(rnd.astype(bits.dtype)).view(dtype)
    payload = round_trip({"t": a, "same": a.clone()}, {"t": other, "same": a.clone()})
    assert {e["n"]: e["k"] for e in body_of(payload)["tensors"]}["t"] == "dense"


def test_an_empty_delta():
    state = {"w": torch.randn(5, 3).to(torch.bfloat16), "b": torch.zeros(0), "n": torch.tensor(7)}
    payload = round_trip(state, {k: v.clone() for k, v in state.items()})
    body = body_of(payload)
    assert [e["k"] for e in body["tensors"]] == ["same"] * 3
    assert not body.get("classes") and not body.get("gaps") and not body.get("steps")
    version, empty = apply_payload(encode_delta({}, {}, base_version=4, version=5), {})
    assert version == 5 and empty == {}


def test_pieces_and_classes_across_tensors_and_dtypes(monkeypatch):
    """Several dtypes in one delta, tensors cut into pieces (a tiny CHUNK), classes shared by
    pieces of several tensors: the class-by-class layout is undone exactly."""
    monkeypatch.setattr(state_bits, "CHUNK", 37)
    gen = torch.Generator().manual_seed(5)
    base, new = {}, {}
    for i, dtype in enumerate(DTYPES * 2):
        n = int(torch.randint(1, 400, (1,), generator=gen))
        t = (torch.randn(n, generator=gen) * 10.0 ** float(torch.randint(-8, 3, (1,), generator=gen))).to(dtype)
        bits = wd._bits(t).copy()
        hit = torch.rand(n, generator=gen) < [0.01, 0.2, 0.9][i % 3]
        bits[hit.numpy()] += bits.dtype.type(1) if dtype != torch.bool else 0
        if dtype == torch.bool:
            bits[hit.numpy()] ^= 1
        base[f"t{i}"], new[f"t{i}"] = t, torch.from_numpy(bits).view(dtype)
    payload = round_trip(base, new)
    listing = body_of(payload)["classes"]
    assert [c for c, _ in listing] == sorted({c for c, _ in listing})


def test_one_ulp_updates_cost_a_few_bits_per_changed_element():
    """An RL-like step: fp32 masters moved by 1e-6 and cast to bf16. The delta costs less than half
    of what the previous format paid (6 bytes a changed element before zlib, ~4.5 after), and
    within ~30% of the entropy of the changes given the base's exponents."""
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(400_000, generator=gen) * 0.02
    base = {"w": master.to(torch.bfloat16)}
    new = {"w": (master + 1e-6 * torch.sign(torch.randn(400_000, generator=gen))).to(torch.bfloat16)}
    payload = round_trip(base, new)
    old, fresh = wd._bits(base["w"]), wd._bits(new["w"])
    changed = old != fresh
    k = int(changed.sum())
    assert 0.005 < k / changed.size < 0.1
    exponent = (old >> 7) & 0xFF
    positions = sum(wd.log2_binomial(int((exponent == e).sum()), int((changed & (exponent == e)).sum()))
                    for e in np.unique(exponent))
    steps = value_classes.ordered(fresh[changed], True).view(np.int16).astype(int) - value_classes.ordered(old[changed], True).view(np.int16)
    bound = positions + k * wd.entropy_bits(steps)
    bits_per_change = len(payload) * 8 / k
    assert bits_per_change < 10
    assert len(payload) * 8 < 1.3 * bound + 8 * 400  # + the header (hashes, names)


def test_varints_round_trip_and_refuse_malformed_input():
    values = np.array([0, 1, 127, 128, 300, 2**14, 2**21 - 1, 2**32, 2**63, 2**64 - 1], np.uint64)
    data = varints.varint_encode(values)
    assert np.array_equal(varints.varint_decode(data, max_count=10), values)
    assert varints.varint_encode(np.array([5, 127], np.uint64)) == b"\x05\x7f"
    assert varints.varint_decode(b"", max_count=0).size == 0
    for bad, kwargs in [(data[:-1], {}), (data, {"max_count": 9}), (b"\x80\x80\x04", {"width_bits": 16}),
                        (b"\xff" * 10 + b"\x01", {}), (b"\xff" * 9 + b"\x02", {}), (b"\x80\x02", {"width_bits": 8})]:
        with pytest.raises(ValueError):
            varints.varint_decode(bad, **{"max_count": 100, **kwargs})
    with pytest.raises(TypeError):
        varints.varint_decode("text", max_count=4)


def test_the_decompressed_size_limit_still_holds():
    versions = train_versions(1)
    payload = encode_delta(versions[0], versions[1], base_version=0, version=1)
    with pytest.raises(CorruptVersion, match="decompresses to more than"):
        apply_payload(payload, versions[0], max_bytes=1000)


# mutations of the streams and listings format 3 added, each applied to a real delta: the result is
# the published state bit for bit, or CorruptVersion (never another exception)

def _states():
    gen = torch.Generator().manual_seed(11)
    base = {"a": (torch.randn(300, generator=gen) * 0.02).to(torch.bfloat16), "b": torch.randn(50, generator=gen),
            "c": torch.randint(0, 9, (20,), generator=gen), "d": (torch.randn(40, generator=gen)).to(torch.float16)}
    new = {k: v.clone() for k, v in base.items()}
    new["a"] = (base["a"].float() + 1e-4 * torch.randn(300, generator=gen)).to(torch.bfloat16)
    new["b"][::7] += 1e-6
    new["c"][3] += 1
    new["d"][5] = float("inf")
    return base, new


BASE, NEW = _states()
DELTA = encode_delta(BASE, NEW, base_version=0, version=1)


def _mutated(rnd: random.Random, body: dict) -> dict:
    what = rnd.choice(("classes", "gaps", "steps", "kind", "entries", "swap"))
    if what in ("classes", "gaps", "steps") and not isinstance(body.get(what), (list, bytes)) or not body["tensors"]:
        what = "swap"
    if what == "classes" and not (body["classes"] and all(isinstance(p, list) and len(p) == 2 for p in body["classes"])):
        what = "swap"
    if what in ("gaps", "steps") and not body[what]:
        what = "swap"
    if what == "classes":
        listing = body["classes"]
        op = rnd.choice(("count", "id", "drop", "dup", "junk"))
        i = rnd.randrange(len(listing))
        # an earlier round may have left a non-int there: nudge only numbers
        def nudged(value):
            return value + rnd.choice((-1, 1)) if isinstance(value, int) else 0

        if op == "count":
            listing[i][1] = rnd.choice((0, -1, nudged(listing[i][1]), 2**40, 2**64 - 1))
        elif op == "id":
            listing[i][0] = rnd.choice((-1, wd.NUM_CLASSES, nudged(listing[i][0]), 2**63))
        elif op == "drop":
            del listing[i]
        elif op == "dup":
            listing.insert(i, list(listing[i]))
        else:
            body["classes"] = rnd.choice((None, 5, "x", [[1]], [[1, 2, 3]], [["a", 1]], [[1.5, 2]]))
    elif what in ("gaps", "steps"):
        data = bytearray(body[what])
        op = rnd.choice(("flip", "truncate", "extend", "cont", "big"))
        pos = rnd.randrange(len(data))
        if op == "flip":
            data[pos] ^= rnd.randrange(1, 256)
        elif op == "truncate":
            del data[pos:]
        elif op == "extend":
            data += bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 6)))
        elif op == "cont":
            data[pos] |= 0x80
        else:
            data[pos:pos + 1] = b"\xff" * rnd.randrange(2, 12) + b"\x01"
        body[what] = bytes(data) if rnd.random() > 0.05 else rnd.choice((None, 3, "text", []))
    elif what == "kind":
        entry = rnd.choice(body["tensors"])
        if isinstance(entry, dict):
            entry["k"] = rnd.choice(("same", "sparse", "dense", "other"))
    elif what == "entries":
        tensors = body["tensors"]
        op = rnd.choice(("reverse", "dup", "drop"))
        if op == "reverse":
            tensors.reverse()
        elif op == "dup":
            tensors.append(dict(rnd.choice(tensors)))
        else:
            del tensors[rnd.randrange(len(tensors))]
    else:
        body["gaps"], body["steps"] = body.get("steps"), body.get("gaps")
    return body


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 3))
def test_mutated_sparse_streams_rebuild_exactly_or_are_refused(seed, rounds):
    rnd = random.Random(seed)
    body = body_of(DELTA)
    for _ in range(rounds):
        body = _mutated(rnd, body)
    payload = wd.delta_payload(body)
    try:
        _, state = apply_payload(payload, BASE)
    except CorruptVersion:
        return
    assert_bit_exact(state, NEW)


def test_the_unmutated_fuzz_delta_applies():
    body = body_of(DELTA)
    assert {e["n"]: e["k"] for e in body["tensors"]} == {"a": "sparse", "b": "sparse", "c": "sparse", "d": "sparse"}
    _, state = apply_payload(DELTA, BASE)
    assert_bit_exact(state, NEW)


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
