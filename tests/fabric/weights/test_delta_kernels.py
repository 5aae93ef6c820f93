"""The weight-delta codec's compiled kernels (swarm/fabric/weights/kernels.py) against its numpy path:
the same format 5 bytes (and undo deltas) for every dtype and bit pattern (NaN, infinities, +-0,
subnormals), the same states on apply, the same refusals; without numba the numpy path runs;
importing compiles nothing."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from swarm.fabric.weights import delta as wd
from swarm.fabric.weights import kernels, state_bits, value_classes, varints
from swarm.fabric.weights.delta import CorruptVersion, apply_payload, encode_delta
from swarm.fabric.weights.undo import apply_chain, encode_undo

pytestmark = pytest.mark.skipif(not kernels.ENABLED, reason="numba is a dependency: installed wherever the tests run")

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.int32, torch.uint8, torch.bool]
WIDTH = {torch.float32: 32, torch.bfloat16: 16, torch.float16: 16, torch.int64: 64, torch.int32: 32, torch.uint8: 8,
         torch.bool: 8}


def specials(dtype) -> list[int]:
    """Bit patterns at the edges: zeros of both signs, infinities, NaNs (quiet, signalling, with a
    payload, negative), the smallest and largest subnormals, the smallest normal, the largest finite."""
    if dtype == torch.bool:
        return [0, 1]
    width = WIDTH[dtype]
    if not dtype.is_floating_point:
        return [0, 1, (1 << width) - 1, 1 << (width - 1), (1 << (width - 1)) - 1]
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    sign, inf = 1 << (width - 1), ((1 << (width - 1 - mantissa)) - 1) << mantissa
    out = [0, 1, (1 << mantissa) - 1, 1 << mantissa, inf - 1, inf, inf | 1, inf | (1 << (mantissa - 1)), (1 << width) - 1]
    return out + [v | sign for v in out]


def tensor(bits: np.ndarray, dtype) -> torch.Tensor:
    if bits.size == 0:
        return torch.empty(0, dtype=dtype)  # (an empty byte tensor viewed as a wider dtype has stride 0)
    return torch.from_numpy(bits.astype(wd._UINT[WIDTH[dtype] // 8])).view(dtype).clone()


def both_paths(monkeypatch, fn):
    """fn() on the numpy path, then with the compiled kernels."""
    out = []
    for enabled in (False, True):
        monkeypatch.setattr(kernels, "ENABLED", enabled)
        out.append(fn())
    return out


def assert_applies_alike(monkeypatch, payload: bytes, base: dict, new: dict) -> None:
    for _, state in both_paths(monkeypatch, lambda: apply_payload(payload, base)):
        for name, t in new.items():
            assert np.array_equal(wd._bits(state[name]), wd._bits(t)), name


@st.composite
def states(draw):
    """One to three tensors of random dtypes and sizes, their elements drawn from the edge patterns and
    random bits, a random share of them changed: by a few steps, to an edge pattern, or to random bits."""
    base, new = {}, {}
    for i in range(draw(st.integers(1, 3))):
        dtype = draw(st.sampled_from(DTYPES))
        width = WIDTH[dtype]
        n = draw(st.integers(0, 300))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        edge = np.array(specials(dtype), np.uint64)
        top = 2 if dtype == torch.bool else 1 << width
        old = np.where(rng.random(n) < draw(st.floats(0, 1)), edge[rng.integers(0, edge.size, n)],
                       rng.integers(0, top, n, dtype=np.uint64, endpoint=False) if width < 64 else rng.integers(0, 2**63, n, dtype=np.uint64) * 2)
        changed = rng.random(n) < draw(st.sampled_from([0.0, 0.03, 0.3, 1.0]))
        how = rng.integers(0, 3, n)
        moved = (old.astype(np.int64) + rng.integers(-3, 4, n)).astype(np.uint64) % np.uint64(top) if width < 64 else \
            old + rng.integers(-3, 4, n).astype(np.uint64)
        fresh = np.where(how == 0, moved, np.where(how == 1, edge[rng.integers(0, edge.size, n)],
                                                   rng.integers(0, top, n, dtype=np.uint64) if width < 64 else old ^ np.uint64(1 << 40)))
        if dtype == torch.bool:
            fresh = old ^ np.uint64(1)
        base[f"t{i}"] = tensor(old, dtype)
        new[f"t{i}"] = tensor(np.where(changed, fresh, old), dtype)
    return base, new


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                                   HealthCheck.function_scoped_fixture])
@given(pair=states(), chunk=st.sampled_from([7, 64, 1 << 20]))
def test_compiled_kernels_write_the_numpy_paths_bytes_for_any_bits(pair, chunk, monkeypatch):
    base, new = pair
    monkeypatch.setattr(state_bits, "CHUNK", chunk)
    numpy_bytes, compiled_bytes = both_paths(monkeypatch, lambda: encode_delta(base, new, base_version=1, version=2))
    assert compiled_bytes == numpy_bytes
    assert_applies_alike(monkeypatch, compiled_bytes, base, new)


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                                   HealthCheck.function_scoped_fixture])
@given(pair=states())
def test_the_compiled_undo_delta_is_the_numpy_paths_byte_for_byte_and_takes_a_version_back(pair, monkeypatch):
    base, new = pair
    numpy_undo, compiled_undo = both_paths(monkeypatch, lambda: encode_undo(new, base, newer=2, newer_hash="n", version=1,
                                                                            version_hash="o"))
    assert compiled_undo == numpy_undo
    back = apply_chain(new, "n", [compiled_undo])
    for name, t in base.items():
        assert np.array_equal(wd._bits(back[name]), wd._bits(t)), name


def test_a_few_megabyte_model_is_byte_identical_on_both_paths(monkeypatch):
    """A one-ulp RL step on 3M bf16 weights (pieces of 1M elements, blocks of 65,535), a norm near 1,
    a float32 bias, an int buffer: the payload on both paths and the states they rebuild."""
    gen = torch.Generator().manual_seed(5)
    master = {"w": torch.randn(3_000_000, generator=gen) * 0.02, "n": torch.ones(4096) + torch.randn(4096, generator=gen) * 1e-3}
    base = {k: v.to(torch.bfloat16) for k, v in master.items()}
    new = {k: (v + 1e-6 * torch.randn(v.shape, generator=gen).sign()).to(torch.bfloat16) for k, v in master.items()}
    base["b"], new["b"] = torch.randn(5000, generator=gen), torch.randn(5000, generator=gen)
    base["steps"], new["steps"] = torch.arange(100, dtype=torch.int64), torch.arange(100, dtype=torch.int64) + (torch.arange(100) % 9 == 0)
    numpy_bytes, compiled_bytes = both_paths(monkeypatch, lambda: encode_delta(base, new, base_version=0, version=1))
    assert compiled_bytes == numpy_bytes
    assert {e["n"]: e["k"] for e in wd.delta_body(compiled_bytes)["tensors"]}["w"] == "sparse"
    assert_applies_alike(monkeypatch, compiled_bytes, base, new)


@settings(max_examples=60, deadline=None, database=None)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), seed=st.integers(0, 2**32 - 1),
       cuts=st.lists(st.integers(0, 300), min_size=3, max_size=3))
def test_ranks_and_members_match_value_classes_at_any_thresholds(dtype, seed, cuts):
    """Thresholds anywhere from 0 to past the largest exponent (ranges empty, or holding everything)."""
    top = value_classes.EXPONENTS[dtype][1] + 1
    thresholds = sorted(min(c, top) for c in cuts)
    rng = np.random.default_rng(seed)
    uint = wd._UINT[WIDTH[dtype] // 8]
    old = rng.integers(0, 1 << WIDTH[dtype], 70_000, dtype=np.uint64).astype(uint)
    new = old.copy()
    hit = rng.random(old.size) < 0.05
    new[hit] += uint(1)
    shift = value_classes.EXPONENTS[dtype][0]
    bounds = kernels.class_bounds(old.dtype, thresholds, shift)
    counts, cls, rank, steps = kernels.ranked_changes(old, new, bounds, True)
    expected_cls, expected_rank, index, members = value_classes.ranked(old, new, dtype, thresholds)
    order = np.argsort(cls, kind="stable")
    assert np.array_equal(counts, members) and np.array_equal(kernels.class_members(old, bounds), members)
    assert np.array_equal(value_classes.members(old, dtype, thresholds), members)
    assert np.array_equal(cls[order], expected_cls) and np.array_equal(rank[order], expected_rank)
    assert np.array_equal(np.flatnonzero(hit)[order], index)


def test_a_change_pushed_past_its_class_is_refused_on_both_paths(monkeypatch):
    """A gap nudged so that a change lands past its class's members: refused on both paths, nothing applied."""
    gen = torch.Generator().manual_seed(1)
    master = torch.randn(200_000, generator=gen) * 0.02
    base, new = {"w": master.to(torch.bfloat16)}, {"w": (master + 2e-6).to(torch.bfloat16)}
    body = wd.delta_body(encode_delta(base, new, base_version=0, version=1))
    last = max(c for c, _ in body["classes"])
    gaps = wd.varint_decode(body["gaps"], max_count=10**9)
    start = sum(k for c, k in body["classes"] if c < last)
    gaps[start] += np.uint64(10**6)  # the class's first change pushed far past its members
    body["gaps"] = varints.varint_encode(gaps)
    for enabled in (False, True):
        monkeypatch.setattr(kernels, "ENABLED", enabled)
        with pytest.raises(CorruptVersion, match="malformed"):
            apply_payload(wd.delta_payload(body), base)


SNIPPET = """
import sys, hashlib, torch
{block}
from swarm.fabric.weights import delta, kernels
print(kernels.ENABLED, "numba" in sys.modules and sys.modules["numba"] is not None)
gen = torch.Generator().manual_seed(2)
m = torch.randn(50_000, generator=gen) * 0.02
base, new = {{"w": m.to(torch.bfloat16)}}, {{"w": (m + 1e-5 * torch.randn(m.shape, generator=gen)).to(torch.bfloat16)}}
print(hashlib.sha256(delta.encode_delta(base, new, base_version=0, version=1)).hexdigest())
print(getattr(kernels.ranked_changes, "signatures", None))
"""


def _run(block: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", SNIPPET.format(block=block)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\n")


def test_without_numba_the_numpy_path_writes_the_same_bytes_and_import_compiles_nothing():
    flags, digest, compiled, _ = _run("")
    assert flags == "True False"  # imported without numba (kernels import it and compile on first use)
    assert compiled.startswith("[(")  # then the encoding ran the compiled kernel
    flags_without, digest_without, compiled_without, _ = _run("sys.modules['numba'] = None  # as if numba were not installed")
    assert flags_without == "False False" and compiled_without == "None"
    assert digest_without == digest


def _decoded(data: bytes, **kwargs):
    """varint_decode's numbers, or the ValueError it raised."""
    try:
        return varints.varint_decode(data, **kwargs)
    except ValueError as exc:
        return exc


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(
    # well-formed: numbers of every width, encoded
    st.lists(st.integers(0, 2**64 - 1), max_size=60).map(lambda v: varints.varint_encode(np.array(v, np.uint64))),
    # anything: truncated, too long, too wide, runs of continuation bytes
    st.binary(max_size=80), st.lists(st.sampled_from([0x00, 0x01, 0x02, 0x7F, 0x80, 0xFF]), max_size=40).map(bytes)),
    width=st.sampled_from([8, 16, 32, 64]), dtype=st.sampled_from([np.uint8, np.uint16, np.uint32, np.uint64]),
    run=st.sampled_from([17, 1 << 18]))
@example(data=b"\xff" * 9 + b"\x02", width=64, dtype=np.uint64, run=1 << 18)  # past 64 bits in its 10th byte
@example(data=b"\xff" * 9 + b"\x01", width=64, dtype=np.uint64, run=1 << 18)  # 2^64 - 1, the widest that fits
@example(data=b"\x80" * 10 + b"\x01", width=64, dtype=np.uint64, run=1 << 18)  # 11 bytes
def test_the_compiled_varint_decoder_gives_the_numpy_paths_numbers_and_refusals(data, width, dtype, run, monkeypatch):
    monkeypatch.setattr(varints, "_DECODE_BYTES", run)  # (17: many runs, each cut back to a varint's end)
    got = []
    for enabled in (False, True):
        monkeypatch.setattr(kernels, "ENABLED", enabled)
        got.append(_decoded(data, max_count=100, width_bits=width, dtype=dtype))
    numpy_path, compiled = got
    if isinstance(numpy_path, ValueError):
        assert isinstance(compiled, ValueError), (data, compiled)
    else:
        assert not isinstance(compiled, ValueError), (data, compiled)
        assert compiled.dtype == numpy_path.dtype and np.array_equal(compiled, numpy_path)
