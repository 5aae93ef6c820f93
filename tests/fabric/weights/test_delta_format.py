"""Format 3 bit by bit: ordered bits, steps in representable values, NaN and infinity, every dtype,
varints, pieces and classes, and the decompression limit."""


import numpy as np
import pytest
import torch

from swarm.fabric.weights import state_bits, value_classes, varints
from swarm.fabric.weights import delta as wd
from swarm.fabric.weights.delta import apply_payload, encode_delta
from tests.helpers.delta_bits import DTYPES, WIDTH, body_of, from_bits, round_trip, signed_steps


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
