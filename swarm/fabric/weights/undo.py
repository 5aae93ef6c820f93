"""Undo deltas: how a VersionStore holds an older version, in this process only, as the changes
that turn the version after it back into it, coded so that a chain of them applies in time
proportional to the changes rather than to the model.

A wire delta (delta.py, format 5) counts each change's position within its class of exponents in
the *base*, which codes positions of real training changes in ~7 bits instead of ~10 but makes
every apply classify every element of its base: a pass over the whole model per version, so the
oldest of 65 versions took 64 passes to rebuild (304 s at 73 M parameters on a busy 2-core
machine). An undo delta lists its changes in index order instead (the gaps between changed
elements, then each one's step: the difference of the float-ordered bits, as delta.py defines it,
zigzag varints, each stream zlib-coded), so a chain is applied by one copy of the newest state and,
per version, a scatter of its changes into that copy. Never sent: the wire format is unaffected.

Each undo delta records the versions and hashes it joins; `apply_chain` checks each step's pairing
(cheap) and the caller hashes the end of the chain (VersionStore.state): a step applied wrongly
anywhere changes the end's bits.
"""

from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from swarm.fabric.weights import kernels
from swarm.fabric.weights.delta import FLOATS, THREADS
from swarm.fabric.weights.value_classes import ordered
from swarm.fabric.weights.varints import unzigzag, varint_array, varint_decode, zigzag
from swarm.fabric.weights.wire_layout import CorruptVersion

LEVEL = 1  # zlib level: the streams are near their entropy already at the fastest level
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's raw bits as a flat unsigned-integer array (a view: writing it writes the tensor)."""
    return t.view(-1).view(torch.uint8).numpy().view(_UINT[t.element_size()])


@dataclass(frozen=True)
class UndoDelta:
    """The changes turning `newer` (hash `newer_hash`) back into `version` (hash `version_hash`):
    per changed tensor, (name, number of changes, zlib'd gap varints, zlib'd zigzag step varints)."""

    version: int
    version_hash: str
    newer: int
    newer_hash: str
    tensors: tuple[tuple[str, int, bytes, bytes], ...]

    @property
    def nbytes(self) -> int:
        return sum(len(g) + len(s) + len(n) + 16 for n, _, g, s in self.tensors) + 200


def encode_undo(newer_state: Mapping[str, torch.Tensor], older_state: Mapping[str, torch.Tensor], *, newer: int,
                newer_hash: str, version: int, version_hash: str) -> UndoDelta:
    """The undo delta from `newer_state` back to `older_state` (same names, dtypes and shapes)."""
    if set(newer_state) != set(older_state):
        raise ValueError(f"tensor names differ between versions: {sorted(set(newer_state) ^ set(older_state))[:5]}")
    names = sorted(newer_state)
    for name in names:
        a, b = newer_state[name], older_state[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            raise ValueError(f"{name}: {a.dtype}{tuple(a.shape)} -> {b.dtype}{tuple(b.shape)}")
    with ThreadPoolExecutor(THREADS, thread_name_prefix="undo-delta") as pool:  # numpy and zlib release the GIL
        coded = list(pool.map(lambda name: _encode_tensor(name, newer_state[name], older_state[name]), names))
    return UndoDelta(version, version_hash, newer, newer_hash, tuple(entry for entry in coded if entry is not None))


def _encode_tensor(name: str, newer: torch.Tensor, older: torch.Tensor) -> tuple[str, int, bytes, bytes] | None:
    new_bits, old_bits = _bits(newer.detach().contiguous().cpu()), _bits(older.detach().contiguous().cpu())
    is_float = newer.dtype in FLOATS
    if kernels.ENABLED:
        count, gap_bytes, step_bytes = kernels.undo_streams(new_bits, old_bits, is_float)
        if count == 0:
            return None
        return name, int(count), zlib.compress(gap_bytes, LEVEL), zlib.compress(step_bytes, LEVEL)
    where = np.flatnonzero(new_bits != old_bits)
    if where.size == 0:
        return None
    steps = zigzag(ordered(old_bits[where], is_float) - ordered(new_bits[where], is_float))
    gap_bytes, _ = varint_array((np.diff(where, prepend=-1) - 1).astype(np.uint64))
    step_bytes, _ = varint_array(steps)
    return name, int(where.size), zlib.compress(gap_bytes, LEVEL), zlib.compress(step_bytes, LEVEL)


def apply_chain(state: Mapping[str, torch.Tensor], state_hash: str, chain: list[UndoDelta]) -> dict[str, torch.Tensor]:
    """`state` (of hash `state_hash`) taken back through `chain` (newest first), into a copy of it.
    Checks that each undo delta starts where the last one ended (versions and hashes); the caller
    checks the result's hash. CorruptVersion: a delta that does not pair, or does not decode."""
    out = {name: t.detach().cpu().contiguous().clone() for name, t in state.items()}
    bits = {name: (_bits(t), t.dtype in FLOATS) for name, t in out.items()}  # views: written in place
    at_version, at_hash = None, state_hash
    with ThreadPoolExecutor(THREADS, thread_name_prefix="undo-apply") as pool:  # tensors are disjoint
        for undo in chain:
            if undo.newer_hash != at_hash or (at_version is not None and undo.newer != at_version):
                raise CorruptVersion(f"undo delta to version {undo.version} starts from version {undo.newer}, "
                                     f"not from the state it is applied to")
            jobs = [(undo.version, entry, *bits.get(entry[0], (None, False))) for entry in undo.tensors]
            for _ in pool.map(_apply_tensor, jobs):  # (in order: the first failure is raised)
                pass
            at_version, at_hash = undo.version, undo.version_hash
    return out


def _apply_tensor(job: tuple[int, tuple[str, int, bytes, bytes], np.ndarray | None, bool]) -> None:
    version, (name, count, gaps_z, steps_z), target, is_float = job
    try:
        if target is None:
            raise KeyError(f"no tensor {name} in the state")
        gaps = varint_decode(zlib.decompress(gaps_z), max_count=count)
        steps = varint_decode(zlib.decompress(steps_z), max_count=count, width_bits=target.dtype.itemsize * 8, dtype=target.dtype)
        if gaps.size != count or steps.size != count:
            raise ValueError(f"{count} changes listed, {gaps.size} gaps and {steps.size} steps held")
        gaps += np.uint64(1)
        where = np.cumsum(gaps, dtype=np.uint64).view(np.int64) - 1
        if count and not 0 <= where[-1] < target.size:
            raise ValueError("a change runs past its tensor")
        target[where] = ordered(ordered(target[where], is_float) + unzigzag(steps), is_float)
    except (KeyError, ValueError, OverflowError, zlib.error) as exc:
        raise CorruptVersion(f"undo delta to version {version} does not decode ({name}): {exc}") from exc
