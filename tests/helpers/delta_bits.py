"""What the delta format's tests share: dtypes, bit patterns, exact comparison and a checked round trip."""

import numpy as np
import torch

from swarm.fabric.weights import delta as wd
from swarm.fabric.weights import varints
from swarm.fabric.weights.delta import apply_payload, encode_delta

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
