"""Applying a weight payload (format 5; swarm.fabric.weights.delta describes it): a snapshot's tensors,
or a delta's changes on its base, with the base's hash checked first and the result's last, so
that a corrupt or misapplied payload is never used. Each sparse tensor is rebuilt piece by piece
on the pool: a copy of the base with its changes placed among each class's members (kernels.py's
one compiled pass; value_classes.target_index on the numpy path)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Mapping

import numpy as np
import torch

from swarm.fabric.weights import kernels
from swarm.fabric.weights import state_bits
from swarm.fabric.weights.state_bits import DTYPES, FLOATS, UINT, hash_state, raw_bits, state_hash, tensor_from_bits, workers
from swarm.fabric.weights.value_classes import (
    CLASS_BITS,
    CLASSES,
    EXPONENTS,
    NUM_CLASSES,
    check_thresholds,
    members as class_members,
    ordered,
    target_index,
)
from swarm.fabric.weights.varints import unzigzag, varint_decode
from swarm.fabric.weights.wire_layout import MAX_PAYLOAD_BYTES, CorruptVersion, delta_body, inflate_fields


def _listing(body: dict, members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The delta's (class ids, changes per class), checked against the members of each class."""
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
    return ids, counts


def _positions(gaps: np.ndarray, ids: np.ndarray, counts: np.ndarray, members: np.ndarray) -> None:
    """Gaps -> each change's position within its class, in place, checked against the class's members."""
    segments = list(zip(ids.tolist(), (np.cumsum(counts) - counts).tolist(), counts.tolist()))
    for c, s, k in segments:
        if k and gaps[s:s + k].max() >= np.uint64(members[c]):
            raise ValueError("a gap runs past its class")
    for c, s, k in segments:
        # every gap is below the class's members (at most 2^48), so the running sum cannot wrap, and
        # positions ascend: the last one is the one to check
        position = gaps[s:s + k]
        position += np.uint64(1)
        np.cumsum(position, out=position)
        position -= np.uint64(1)
        if k and position[-1] >= np.uint64(members[c]):
            raise ValueError("a position runs past its class")


def _check_step_widths(steps: np.ndarray, ids: np.ndarray, counts: np.ndarray) -> None:
    """Each change's step must fit in its tensor's element width."""
    widths = CLASS_BITS[ids]
    ends = np.cumsum(counts)
    for width in np.unique(widths).tolist():
        if width >= steps.dtype.itemsize * 8:
            continue  # the decoder checked these
        for j in np.flatnonzero(widths == width).tolist():
            if (steps[ends[j] - counts[j]:ends[j]] >> steps.dtype.type(width)).any():
                raise ValueError(f"a step wider than {width} bits")


def _apply_piece(out: np.ndarray, base: np.ndarray, dtype: torch.dtype, thresholds: list[int] | None, lo: np.ndarray,
                 hi: np.ndarray, cls: np.ndarray, before: np.ndarray, positions: np.ndarray, steps: np.ndarray) -> None:
    """Copy a piece of the base to `out` and apply its changes: for each class with changes in the
    piece, the changes lo..hi of the streams (`before`: the class's members in earlier pieces)."""
    if kernels.ENABLED:  # the copy, the listing of members and the steps in one pass
        bounds = kernels.class_bounds(base.dtype, thresholds, EXPONENTS[dtype][0] if thresholds is not None else None)
        if not kernels.apply_changes(out, base, bounds, dtype in FLOATS, cls, np.ascontiguousarray(lo), np.ascontiguousarray(hi),
                                     before, positions, steps):
            raise ValueError("a change ranked past its class's members")
        return
    out[:] = base
    lengths = hi - lo
    total = int(lengths.sum())
    if total == 0:
        return
    at = np.repeat(lo - np.cumsum(lengths) + lengths, lengths) + np.arange(total)  # the changes' places in the streams
    rank = positions[at].astype(np.int64) - np.repeat(before, lengths)
    step = unzigzag(steps[at].astype(out.dtype))
    del at
    index = target_index(base, dtype, thresholds, np.repeat(cls, lengths), rank)
    is_float = dtype in FLOATS
    out[index] = ordered(ordered(out[index], is_float) + step, is_float)


def _ranges(body: dict, dtypes: set) -> dict:
    """Each float dtype's ranges (value_classes.check_thresholds), as the payload gives them for its
    sparse tensors' dtypes."""
    given = body.get("ranges", {})
    if not isinstance(given, dict):
        raise TypeError("ranges is not a map")
    floats = sorted((d for d in dtypes if d in EXPONENTS), key=str)
    missing = [str(d) for d in floats if str(d) not in given]
    if missing:
        raise ValueError(f"no ranges given for the sparse tensors of {missing}")
    return {d: check_thresholds(d, given[str(d)]) for d in floats}


def _members(bits: np.ndarray, dtype: torch.dtype, thresholds: list[int] | None) -> np.ndarray:
    """Members of each of the dtype's classes in a piece of a base (value_classes.members)."""
    if not kernels.ENABLED:
        return class_members(bits, dtype, thresholds)
    bounds = kernels.class_bounds(bits.dtype, thresholds, EXPONENTS[dtype][0] if thresholds is not None else None)
    return kernels.class_members(bits, bounds)[:CLASSES[dtype][1]]


def _sparse_jobs(body: dict, targets: list[tuple[np.ndarray, np.ndarray, torch.dtype]], pool) -> list[tuple[int, tuple]]:
    """The work of applying a delta's class-by-class streams to its sparse tensors (in entry order),
    given each one's (bits to write, base bits, dtype): checks the streams against the base's
    classes, then returns, per piece, (its tensor's place in `targets`, _apply_piece's arguments)."""
    ranges = _ranges(body, {dtype for _, _, dtype in targets})
    pieces = [(i, start, end) for i, (_, base, _) in enumerate(targets) for start, end in state_bits.pieces(base.size)]
    blocks = [pool.submit(_members, targets[i][1][start:end], targets[i][2], ranges.get(targets[i][2]))
              for i, start, end in pieces]
    table = np.zeros((len(pieces) + 1, NUM_CLASSES), np.int64)  # members of each class before each piece
    for p, ((i, _, _), future) in enumerate(zip(pieces, blocks)):
        first = CLASSES[targets[i][2]][0]
        counts = future.result()
        table[p + 1, first:first + counts.size] = counts
    np.cumsum(table, axis=0, out=table)
    members = table[-1]
    ids, counts = _listing(body, members)
    total = int(counts.sum())
    widest = int(CLASS_BITS[ids].max()) if ids.size else 64
    gaps = varint_decode(body.get("gaps", b""), max_count=total, pool=pool)
    steps = varint_decode(body.get("steps", b""), max_count=total, dtype=UINT[widest // 8], pool=pool)  # wider: refused
    body.pop("gaps", None), body.pop("steps", None)  # decoded: their bytes are no longer needed
    if gaps.size != total or steps.size != total:
        raise ValueError(f"{total} changed elements listed, {gaps.size} gaps and {steps.size} steps sent")
    _positions(gaps, ids, counts, members)
    _check_step_widths(steps, ids, counts)
    # each class's changes, piece by piece: bounds[j, p] is where class ids[j]'s changes in piece p start
    bounds = np.zeros((ids.size, len(pieces) + 1), np.int64)
    for j, (c, s, k) in enumerate(zip(ids.tolist(), (np.cumsum(counts) - counts).tolist(), counts.tolist())):
        bounds[j] = s + np.searchsorted(gaps[s:s + k], table[:, c].astype(np.uint64))
    jobs = []
    for p, (i, start, end) in enumerate(pieces):
        out, base, dtype = targets[i]
        first, count = CLASSES[dtype]
        j0, j1 = np.searchsorted(ids, [first, first + count])
        jobs.append((i, (out[start:end], base[start:end], dtype, ranges.get(dtype), bounds[j0:j1, p], bounds[j0:j1, p + 1],
                         (ids[j0:j1] - first).astype(np.uint8), table[p, ids[j0:j1]], gaps, steps)))
    return jobs


def payload_header(payload: bytes, max_bytes: int = MAX_PAYLOAD_BYTES) -> dict:
    """kind, version, base, base_hash, hash of a payload (decodes it; raises CorruptVersion)."""
    body = _load(payload, max_bytes, inflate=False)
    return {k: body[k] for k in ("kind", "version", "base", "base_hash", "hash")}


def _load(payload: bytes, max_bytes: int = MAX_PAYLOAD_BYTES, pool=None, *, inflate: bool = True) -> dict:
    body = delta_body(payload, max_bytes, pool, inflate=inflate)
    if body.get("kind") not in ("delta", "snapshot"):
        raise CorruptVersion("payload is not a weight version (kind is neither delta nor snapshot)")
    if not (isinstance(body.get("version"), int) and isinstance(body.get("hash"), str) and isinstance(body.get("tensors"), list)
            and (body["kind"] == "snapshot" or isinstance(body.get("base_hash"), str))):
        raise CorruptVersion("payload's header is malformed (version, hash, base_hash or tensors)")
    body.setdefault("base", None)
    body.setdefault("base_hash", None)
    return body


def apply_payload(payload: bytes, base: Mapping[str, torch.Tensor] | None = None, *,
                  max_bytes: int = MAX_PAYLOAD_BYTES, base_hash: str | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    """(version, state) from a snapshot, or from a delta applied to `base`. The result's hash is
    checked against the one the publisher computed: a mismatch raises CorruptVersion. max_bytes
    bounds the decompressed payload and the state it builds."""
    version, state, _, _ = apply_payload_verified(payload, base, max_bytes=max_bytes, base_hash=base_hash)
    return version, state


def _shape(value) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(d, int) and 0 <= d < 2**48 for d in value):
        raise ValueError(f"malformed shape {value!r}")
    return tuple(value)


_MALFORMED = (KeyError, IndexError, ValueError, RuntimeError, TypeError, OverflowError)


def _entries(body: dict, base: Mapping[str, torch.Tensor] | None):
    """The payload's tensors: (state, sparse targets). Dense and unchanged tensors are filled in;
    a sparse one gets bits to write and its base's bits: (name, bits, base bits, dtype)."""
    state: dict[str, torch.Tensor] = {}
    sparse = []
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
            state[name] = tensor_from_bits(np.frombuffer(entry["b"], dtype=UINT[width]), dtype, shape)
            continue
        if kind not in ("same", "sparse") or body["kind"] != "delta":
            raise ValueError(f"tensor kind {kind!r} in a {body['kind']}")
        held = base[name]
        if held.dtype != dtype or tuple(held.shape) != shape:
            raise ValueError(f"{name}: the base holds {held.dtype}{tuple(held.shape)}, the entry {dtype}{shape}")
        if kind == "same":
            bits = raw_bits(held).copy()
        else:  # written piece by piece by the pool (a copy of the base's, then the changes)
            bits = np.empty(held.numel(), UINT[width])
            sparse.append((name, bits, raw_bits(held), dtype))
        state[name] = tensor_from_bits(bits, dtype, shape, copy=False)  # shares `bits`
    return state, sparse


def apply_payload_verified(payload: bytes, base: Mapping[str, torch.Tensor] | None = None, *,
                           max_bytes: int = MAX_PAYLOAD_BYTES,
                           base_hash: str | None = None) -> tuple[int, dict[str, torch.Tensor], str, str]:
    """(version, state, hash, kind): as apply_payload, also returning the verified hash and the kind.
    `base_hash`: state_hash(base) when the caller knows it (a version it verified): not hashed again."""
    body = _load(payload, max_bytes, inflate=False)
    delta = body["kind"] == "delta"
    if delta and base is None:
        raise CorruptVersion(f"version {body['version']} is a delta against {body['base']}, and no base was given")

    def check_base() -> None:
        if delta and held_hash.result() != body["base_hash"]:
            raise CorruptVersion(f"delta to version {body['version']} does not apply to this base (not version {body['base']})")

    def malformed(exc: Exception) -> CorruptVersion:
        return CorruptVersion(f"version {body['version']} is malformed: {type(exc).__name__}: {exc}")

    with workers() as pool:
        # checked before anything else is said
        held_hash = (pool.submit(lambda: base_hash) if base_hash is not None else pool.submit(state_hash, base)) if delta else None
        try:
            if delta:
                inflate_fields(body, max_bytes, pool)
        except CorruptVersion:
            check_base()
            raise
        try:
            state, sparse = _entries(body, base)
            jobs = _sparse_jobs(body, [(bits, held, dtype) for _, bits, held, dtype in sparse], pool) if delta else []
        except _MALFORMED as exc:
            check_base()
            raise malformed(exc) from exc
        check_base()
        pending: dict[str, list[Future]] = {}
        for i, args in jobs:
            pending.setdefault(sparse[i][0], []).append(pool.submit(_apply_piece, *args))
        try:  # the result's hash, tensor by tensor as the pool finishes them
            digest = hash_state(state, pending)
        except _MALFORMED as exc:
            raise malformed(exc) from exc
    if digest != body["hash"]:
        raise CorruptVersion(f"version {body['version']} does not match its hash: discarded")
    return body["version"], state, body["hash"], body["kind"]
