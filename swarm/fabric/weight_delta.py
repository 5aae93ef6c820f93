"""Policy versions on the wire: a full snapshot, or a compact delta against the previous published
version, such that every receiver reconstructs the published weights bit for bit.

Deltas compare raw bits, not values: each tensor is viewed as unsigned integers of its element
width, the elements whose bits changed are listed (sorted indices, stored as gaps, plus their new
bits), or the whole tensor is sent when that is smaller. At RL learning rates most bf16 elements do
not change between consecutive versions, so the sparse form is small, and zlib shrinks the gaps
further. Every version is named by a hash of its exact contents (`state_hash`); `apply_payload`
checks the base it is applied to and the result, so a corrupt or misapplied delta is never used.

Layout of a payload: one codec byte, b"Z" (zlib-compressed, for deltas: gaps and sparse bits
compress well) or b"R" (raw, for snapshots: weights are high-entropy, zlib saves ~20% of a bf16
snapshot at ~40x the time of sending it on a fast link), then a msgpack map:
  v int (format), kind "delta" | "snapshot", version int, base int | None, base_hash str | None,
  hash str, tensors: [ {n name, d dtype, s shape, k "same" | "sparse" | "dense", i gaps (uint32
  bytes), b bits (bytes)} ]
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Mapping

import msgpack
import numpy as np
import torch

FORMAT = 2
# No weight payload, received or decompressed, may be larger than this: a hostile holder must not
# make a peer allocate without bound. 4 GiB covers a float16 snapshot of a 2B-parameter policy;
# peers pass a tighter bound from their own model's shapes (versions.payload_limit).
MAX_PAYLOAD_BYTES = 4 * 1024**3
DTYPES = {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16,
          "torch.int64": torch.int64, "torch.int32": torch.int32, "torch.uint8": torch.uint8, "torch.bool": torch.bool}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class CorruptVersion(ValueError):
    """A snapshot or delta that does not decode, or whose result does not match its hash."""


def _bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's raw bits as a flat unsigned-integer array (a view, no conversion of values)."""
    t = t.detach().contiguous().cpu()
    width = t.element_size()
    return t.view(-1).view(torch.uint8).numpy().view(_UINT[width])


def _from_bits(bits: np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
    raw = torch.from_numpy(np.ascontiguousarray(bits).view(np.uint8).copy())
    return raw.view(dtype).reshape(shape)


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
                 level: int = 6) -> bytes:
    """A delta turning `base` (published as `base_version`) into `new` (`version`), bit for bit."""
    if set(base) != set(new):
        raise ValueError(f"tensor names differ between versions: {sorted(set(base) ^ set(new))[:5]}")
    tensors = []
    for name in sorted(new):
        a, b = base[name], new[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            raise ValueError(f"{name}: {a.dtype}{tuple(a.shape)} -> {b.dtype}{tuple(b.shape)}; send a snapshot instead")
        old_bits, new_bits = _bits(a), _bits(b)
        changed = np.flatnonzero(old_bits != new_bits)
        entry = {"n": name, "d": str(b.dtype), "s": list(b.shape)}
        if changed.size == 0:
            entry["k"] = "same"
        elif changed.size * (4 + b.element_size()) < new_bits.size * b.element_size():
            gaps = np.diff(changed, prepend=0).astype(np.uint32)  # small numbers: compress well
            entry.update(k="sparse", i=gaps.tobytes(), b=new_bits[changed].tobytes())
        else:
            entry.update(k="dense", b=new_bits.tobytes())
        tensors.append(entry)
    body = {"v": FORMAT, "kind": "delta", "version": version, "base": base_version, "base_hash": state_hash(base),
            "hash": state_hash(new), "tensors": tensors}
    return b"Z" + zlib.compress(msgpack.packb(body, use_bin_type=True), level)


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
    try:
        for entry in body["tensors"]:
            dtype, shape, kind = DTYPES[entry["d"]], tuple(entry["s"]), entry["k"]
            if not isinstance(entry["n"], str):
                raise TypeError(f"tensor name {entry['n']!r} is not a string")
            width = torch.empty(0, dtype=dtype).element_size()
            if kind == "dense":
                state[entry["n"]] = _from_bits(np.frombuffer(entry["b"], dtype=_UINT[width]), dtype, shape)
                continue
            bits = _bits(base[entry["n"]]).copy()
            if kind == "sparse":
                index = np.cumsum(np.frombuffer(entry["i"], dtype=np.uint32).astype(np.int64))
                bits[index] = np.frombuffer(entry["b"], dtype=_UINT[width])
            state[entry["n"]] = _from_bits(bits, dtype, shape)
    except (KeyError, IndexError, ValueError, RuntimeError, TypeError) as exc:
        raise CorruptVersion(f"version {body['version']} is malformed: {type(exc).__name__}: {exc}") from exc
    if state_hash(state) != body["hash"]:
        raise CorruptVersion(f"version {body['version']} does not match its hash: discarded")
    return body["version"], state, body["hash"], body["kind"]
