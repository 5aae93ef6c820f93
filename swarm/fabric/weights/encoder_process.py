"""A publisher's encoding in a process of its own: the digest, the forward delta and the undo delta
of each version are computed where no Python-level work can hold the training thread's GIL.

Why a process: the codec's Python-level work (its loops over tensors, the numpy calls between the
GIL-free ones) holds the GIL, and CPython hands it to another thread only every
sys.getswitchinterval() (5 ms). A GPU learner's training thread needs the GIL for each of its
thousands of kernel launches a step, so a publisher *thread* held it up by 0.8 s a step at
Qwen3-0.6B shape on an H100 machine with 16 idle cores (1.19 s -> 1.99 s a step).

Nothing of a state is pickled: the parent copies each submitted state straight into one block of
shared memory (`SharedState`: every tensor a view into it, aligned), and the block travels to the
child through torch.multiprocessing as a handle (one file descriptor, not 1.2 GB). The child keeps
the last state it encoded (the base of the next delta: no copy) and sends back only the digest,
the delta (~20 MB at 0.6B) and the undo delta (~24 MB), the latter two's bytes in a file in
/dev/shm (payload_files.py); the parent's VersionStore holds the same shared-memory tensors as the
version's whole state.

A version's whole snapshot (what new samplers fetch in chunks: 4.5 s at Qwen3-0.6B shape on an
H100 machine, hashing included) is encoded there too, on request (`snapshot`): the child is sent
the version's shared block again and writes the payload to a file in /dev/shm, which the parent
reads with one read() (the kernel copies it, the GIL released; a pipe's 64 KiB reads each took the
GIL back: on a busy 2-core machine the training thread stepped 2.7x slower while 300 MB came
through one, against 1.7x while the parent encoded it itself, benchmarks/snapshot_offload.py).
The same bytes as encode_snapshot gives in the parent.

The child is started with the spawn method (a process holding CUDA must never fork) and imports
only torch and the codec (delta.py, undo.py), not the parent's main module, nor transformers.
It ignores SIGINT and SIGTERM (a Ctrl-C reaches the whole process group: the learner publishes
its last version before it stops, so the child must outlive the signal) and ends when told to,
or when the parent goes (its end of the pipe closes).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.multiprocessing  # noqa: F401  registers the reductions that send tensors as shared-memory handles

from swarm.fabric.weights.delta import encode_delta, encode_snapshot, state_hash
from swarm.fabric.weights.payload_files import (EncoderError, carried, payload_path, received, remove, shared_memory_free,
                                                sweep_orphans)
from swarm.fabric.weights.undo import UndoDelta, encode_undo

logger = logging.getLogger(__name__)

ALIGN = 64  # bytes: every tensor's view starts on a cache line (and on its element size, as view(dtype) needs)
STOP_WAIT_S = 10.0  # how long a child gets to finish and leave before it is killed


class EncoderDied(RuntimeError):
    """The encoding process ended without answering (killed, out of memory, crashed)."""


@dataclass(frozen=True)
class SharedState:
    """A state's tensors as views into one block of shared memory (`block`, uint8): `layout` holds
    (name, dtype, shape, byte offset) per tensor, so the other process rebuilds the same views."""

    block: torch.Tensor
    layout: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]

    @classmethod
    def allocate(cls, like: Mapping[str, torch.Tensor], pool: "BlockPool | None" = None,
                 dtype: torch.dtype | None = None) -> "SharedState":
        """Uninitialised shared memory for tensors of `like`'s names, dtypes and shapes (from `pool`
        when it has a free block of the size); floating-point ones as `dtype`, when given."""
        layout, offset = [], 0
        for name, t in like.items():
            cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
            layout.append((name, cast, tuple(t.shape), offset))
            offset += -(-t.numel() * cast.itemsize // ALIGN) * ALIGN
        size = max(offset, 1)
        block = pool.take(size) if pool is not None else None
        return cls(block if block is not None else new_block(size, pool), tuple(layout))

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, dtype, shape, offset in self.layout:
            size = dtype.itemsize * _numel(shape)
            out[name] = self.block[offset:offset + size].view(dtype).view(shape)
        return out

    @classmethod
    def copy_of(cls, state: Mapping[str, torch.Tensor], pool: "BlockPool | None" = None,
                dtype: torch.dtype | None = None) -> "SharedState":
        """A shared copy of CPU tensors, floating-point ones cast to `dtype` when given (the copies
        release the GIL)."""
        shared = cls.allocate(state, pool, dtype)
        for name, view in shared.tensors.items():
            view.copy_(state[name])
        return shared


class SharedTensors(dict):
    """A SharedState's tensors by name that knows its SharedState (a publisher's snapshot that
    needs no copy into shared memory: Publisher.copy_state)."""

    def __init__(self, shared: SharedState) -> None:
        super().__init__(shared.tensors)
        self.shared = shared


class NoSharedMemory(RuntimeError):
    """/dev/shm has no room for a version (the publisher then encodes in its thread)."""


def new_block(size: int, pool: "BlockPool | None" = None) -> torch.Tensor:
    """`size` bytes of shared memory (kept by `pool` for reuse, when given). NoSharedMemory where
    /dev/shm has less room: checked first, since a tmpfs takes a file larger than its room and the
    writes past it kill the process with SIGBUS (Docker's default /dev/shm is 64 MB)."""
    free = shared_memory_free()
    if free is not None and free < size:
        raise NoSharedMemory(f"no room for a version's {size / 1e9:.2f} GB in shared memory (/dev/shm has "
                             f"{free / 1e9:.2f} GB free); give /dev/shm more room (docker: --shm-size)")
    try:
        storage = torch.UntypedStorage._new_shared(size)
    except RuntimeError as exc:
        raise NoSharedMemory(f"no room for a version's {size / 1e9:.2f} GB in shared memory ({exc}); give /dev/shm more "
                             "room (docker: --shm-size)") from exc
    block = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,), (1,))
    del storage  # (the block alone holds it: the pool's count of a free block)
    if pool is not None:
        pool.keep(block)
    return block[:]  # (a view of its own: see BlockPool.take)


def _use_count(block: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(block.untyped_storage()._cdata)


class BlockPool:
    """Blocks of shared memory reused once nothing but the pool refers to them: a version's block is
    free again once the store stopped holding it whole (and the child, which reads only its base and
    the version it encodes, moved on before the store did). Fresh shared memory costs a page fault
    per 4 KiB page on its first write (1.2 GB: ~300,000, with the kernel zeroing each), every
    version; a reused block costs only the copy. `most`: blocks kept (a learner has up to four in
    use: the newest whole state, the version being encoded, the one waiting, and the next being
    cast by copy_state; one more for a verifier reading an older one)."""

    def __init__(self, most: int = 5) -> None:
        self.most = most
        self._blocks: list[tuple[torch.Tensor, int]] = []  # (block, its use count when only the pool holds it)
        self._lock = threading.Lock()
        self.reused = 0

    def take(self, size: int) -> torch.Tensor | None:
        """A free block of `size` bytes, or None. Free blocks of other sizes are let go."""
        if not hasattr(torch._C, "_storage_Use_Count"):
            return None
        with self._lock:
            found, kept = None, []
            for block, alone in self._blocks:
                free = _use_count(block) == alone
                if free and found is None and block.numel() == size:
                    # a view of its own, made under the lock: whoever holds the SharedState (a version
                    # waiting, or being encoded by the child, which holds no count of it here) holds
                    # the block. Handed out as the pool's own tensor, a block in use looked free once
                    # its tensors' views were dropped, and the training thread's next copy_state cast
                    # the next version into the block the child was still encoding
                    found = block[:]
                elif free and block.numel() != size:
                    continue  # another model's shapes: let go
                kept.append((block, alone))
            self._blocks = kept
            self.reused += found is not None
            return found

    def keep(self, block: torch.Tensor) -> None:
        if not hasattr(torch._C, "_storage_Use_Count"):
            return
        with self._lock:
            if len(self._blocks) < self.most:
                self._blocks.append((block, _use_count(block)))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True)
class Encoded:
    """What the child computed for one version."""

    digest: str
    delta: bytes | None  # from the job's base (None: no base)
    undo: UndoDelta | None  # from this version back to the base, when asked for
    seconds: float


@contextmanager
def _bare_main():
    """While a spawned child is started: a main module with nothing to re-import, so the child does
    not run the parent's script (the `swarm` command, a benchmark, pytest) and its imports again."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


class EncoderProcess:
    """The parent's side: starts the child, hands it jobs one at a time (`encode`), and stops it.
    Thread-safe: one job at a time, and `stop` waits for the job under way."""

    def __init__(self, *, nice: int = 0, idle: bool = False, name: str = "version-encoder") -> None:
        sweep_orphans()
        context = multiprocessing.get_context("spawn")
        self._conn, child_end = context.Pipe(duplex=True)
        self.process = context.Process(target=serve, args=(child_end, nice, idle), name=name, daemon=True)
        with _bare_main():
            self.process.start()
        child_end.close()
        self._lock = threading.Lock()
        self.holds: tuple[int, str] | None = None  # (version, hash) of the state the child keeps as the next base
        self._stopped = False

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def encode(self, version: int, state: SharedState, *, base: tuple[int, str] | None = None,
               base_state: SharedState | None = None, undo: bool = False, delay_s: float = 0.0) -> Encoded:
        """The digest of `state` as `version`, and (with `base`, the (version, hash) of the last
        published state) the delta from the base and, when `undo`, the undo delta back to it. The
        child uses the state it holds as the base unless `base_state` is given (it holds another).
        Raises what the child raised, or EncoderDied."""
        with self._lock:
            if self._stopped:
                raise EncoderDied("the encoding process was stopped")
            if base is not None and base_state is None and self.holds != base:
                raise ValueError(f"the encoding process holds {self.holds}, not the base {base}: send the base state")
            path = payload_path("delta", self.process.pid, version)
            job = {"version": version, "block": state.block, "layout": state.layout, "base": base, "undo": undo,
                   "delay_s": delay_s, "base_state": None if base_state is None else (base_state.block, base_state.layout),
                   "path": path}
            try:
                self._conn.send(job)
                reply = self._reply(version)
            except (OSError, EOFError) as exc:  # a broken pipe: the child is gone
                remove(path)
                raise self._died(version) from exc
            except EncoderDied:
                remove(path)
                raise
            if reply[0] == "error":
                remove(path)  # (written, perhaps, before the error)
                _, exc, text = reply
                logger.error("encoding version %d failed in the encoding process:\n%s", version, text)
                raise exc
            _, digest, carried, seconds = reply
            delta, undo_delta = received(carried)
            self.holds = (version, digest)
            return Encoded(digest, delta, undo_delta, seconds)

    def snapshot(self, version: int, state: SharedState) -> bytes:
        """The snapshot payload of `state` as `version` (encode_snapshot's bytes), encoded in the
        child; it leaves the state the child keeps as the next base as it is. Raises what the child
        raised, or EncoderDied."""
        with self._lock:
            if self._stopped:
                raise EncoderDied("the encoding process was stopped")
            try:
                path = payload_path("snapshot", self.process.pid, version)
                self._conn.send({"kind": "snapshot", "version": version, "block": state.block, "layout": state.layout,
                                 "path": path})
                reply = self._reply(version)
            except (OSError, EOFError) as exc:
                raise self._died(version) from exc
            if reply[0] == "error":
                _, exc, text = reply
                logger.info("encoding the snapshot of version %d failed in the encoding process:\n%s", version, text)
                raise exc
            try:
                with open(path, "rb") as f:
                    payload = f.read()
            finally:
                remove(path)
            if len(payload) != reply[2]:
                raise EncoderError(f"the snapshot of version {version} came back as {len(payload)} bytes, not {reply[2]}")
            return payload

    def _reply(self, version: int):
        while True:
            ready = multiprocessing.connection.wait([self._conn, self.process.sentinel])
            if self._conn in ready:  # an answer first, even when the child has ended since
                return self._conn.recv()
            if self.process.sentinel in ready:
                raise self._died(version)

    def _died(self, version: int) -> EncoderDied:
        self.process.join(timeout=5)
        code = self.process.exitcode
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
            if -code == signal.SIGKILL:
                how += " (what the kernel's out-of-memory killer sends)"
        else:
            how = f"ended with exit code {code}"
        self._stopped = True
        return EncoderDied(f"the encoding process (pid {self.process.pid}) {how} while encoding version {version}")

    def stop(self) -> None:
        """Asks the child to leave once its job is done (it holds no version half-done), then kills it
        should it not. Idempotent; leaves no process behind."""
        with self._lock:
            self._stopped = True
            if self.process.is_alive():
                try:
                    self._conn.send(None)
                except OSError:
                    pass
                self.process.join(STOP_WAIT_S)
                if self.process.is_alive():
                    logger.warning("the encoding process (pid %s) did not stop: killed", self.process.pid)
                    self.process.kill()
                    self.process.join(STOP_WAIT_S)
            self._conn.close()


def _leave() -> None:
    """Ends the child at once: it holds nothing to save, and a Python with torch loaded takes seconds
    to tear itself down (over 10 s for a niced child on a busy 2-core machine), which `stop` and
    every learner's exit would wait for."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(0)


def serve(conn, nice: int, idle: bool = False) -> None:
    """The child's loop: one job at a time, until told to stop or the parent goes. `idle`: at idle
    priority (Linux's SCHED_IDLE, which the codec's worker threads inherit): it runs on CPU time no
    other thread wants and never preempts one that wakes, where a niced child still took its share
    of a CPU learner's busy cores and stalled the step's parallel work (swarm.fabric.weights.publisher)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if nice and hasattr(os, "nice"):
        try:
            os.nice(nice)
        except OSError:
            pass
    if idle and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass
    held: tuple[int, str, dict[str, torch.Tensor]] | None = None  # the last state encoded: the next base
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            job = None
        if job is None:
            _leave()
        if job.get("kind") == "snapshot":
            _send_snapshot(conn, job)
            continue
        try:
            started = time.perf_counter()
            version, base = job["version"], job["base"]
            state = SharedState(job["block"], job["layout"]).tensors
            if job["base_state"] is not None:
                held = (base[0], base[1], SharedState(*job["base_state"]).tensors)
            if job["delay_s"]:
                time.sleep(job["delay_s"])
            digest = state_hash(state)
            delta = undo = None
            if base is not None:
                if held is None or (held[0], held[1]) != tuple(base):
                    raise RuntimeError(f"the encoding process holds version {held and held[0]}, not the base {base[0]}")
                delta = encode_delta(held[2], state, base_version=base[0], version=version, base_hash=base[1], new_hash=digest)
                if job["undo"]:
                    undo = encode_undo(state, held[2], newer=version, newer_hash=digest, version=base[0], version_hash=base[1])
            held = (version, digest, state)
            reply = ("done", digest, carried(job.get("path"), delta, undo), time.perf_counter() - started)
        except BaseException as exc:  # noqa: BLE001  sent back, raised in the parent
            text = traceback.format_exc()
            reply = ("error", exc, text)
        try:
            conn.send(reply)
        except (EOFError, OSError):  # the parent is gone: it will never read the file
            if reply[0] == "done" and reply[2][0] == "file":
                remove(reply[2][1])
        except Exception as exc:  # noqa: BLE001  an exception that does not pickle (pickling fails before anything
            # is sent): sent as its text
            conn.send(("error", EncoderError(f"{type(reply[1]).__name__}: {reply[1]} ({exc})"), traceback.format_exc()))


def _send_snapshot(conn, job: dict) -> None:
    """The child's answer to a snapshot job: the payload written to job["path"], then ("snapshot",
    seconds, its size). NoSharedMemory where the file system has no room for it (nothing left there)."""
    path = job["path"]
    try:
        started = time.perf_counter()
        payload = encode_snapshot(SharedState(job["block"], job["layout"]).tensors, job["version"])
        free = shared_memory_free(os.path.dirname(path))
        if free is not None and free < len(payload):
            raise NoSharedMemory(f"no room for a snapshot's {len(payload) / 1e9:.2f} GB in {os.path.dirname(path)} "
                                 f"({free / 1e9:.2f} GB free)")
        with open(path, "wb") as f:
            f.write(payload)
        reply = ("snapshot", time.perf_counter() - started, len(payload))
    except BaseException as exc:  # noqa: BLE001  sent back, raised in the parent
        remove(path)
        reply = ("error", exc, traceback.format_exc())
    try:
        conn.send(reply)
    except Exception as unsent:  # noqa: BLE001  an exception that does not pickle
        conn.send(("error", EncoderError(f"{type(reply[1]).__name__}: {reply[1]} ({unsent})"), traceback.format_exc()))
