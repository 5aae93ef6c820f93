"""A learner's publisher: makes versions public from a thread of its own, so that the next step
trains while the last version is encoded, hashed and announced.

At Qwen3-0.6B shape a GPU learner steps in 1.2-1.5 s while encoding a version's delta takes 5-6 s
and hashing it 0.85 s on the CPU: published in the training loop, versions would cost about five
times the step. Here the training thread hands over a snapshot of the weights (cast to the publish dtype
where they are: on a GPU, a copy on the GPU that the publisher's thread takes to the host on a
CUDA stream of its own, so that the copy overlaps the next step) and goes on; the publisher holds at most one version
waiting. When encoding falls behind, a newer snapshot replaces the waiting one (that version is
skipped, never published), and the next delta is encoded against the last *published* state, so
the skipped version's change is carried in it: versions are never queued without bound, and what
samplers see is always the newest the publisher could keep up with.

What is public follows what was published, never what was trained: the store's `latest`, its
hashes and the `on_published` callback (the learner's published.json, the inbox's version, the
announcement) all move once a version is held and hashed. A failure in the publisher's thread is
kept and raised in the training thread at its next `submit` (or `wait`), never swallowed.

Where the encoding runs (`isolation`): "thread" encodes in the publisher's thread, in this process;
"process" in a process of its own (encoder_process.py), so that the codec's Python-level work
never holds the GIL the training thread needs for its kernel launches (a GPU learner's steps took
1.99 s instead of 1.19 s at Qwen3-0.6B shape with the thread). In "process" the publisher's thread
copies each state into shared memory (the store then holds those tensors), hands the child its
handle, and adds what comes back (digest, delta, undo delta) to the store; everything else (the
queue of one, skipping, the callbacks, failures raised in the training thread, `close`) is the same.
There the newest version's snapshot is encoded in a process too when the store is asked for it
(the store's `snapshot_encoder`: what new samplers fetch, 4.5 s at Qwen3-0.6B shape in the
learner's process), from the same shared block, by a second encoding process started at the first
snapshot (in the first, each snapshot would hold the next version's delta back); should it fail,
the store encodes the snapshot itself.
The child dying (killed, out of memory) is a failure like any other: nothing of the version it was
encoding is published.

The thread (and the encoding process) runs at a lower scheduling priority (`nice`, Linux: per thread, and inherited by the
codec's worker threads it starts); on a GPU learner the CPU is idle anyway. On a CPU learner, whose
training keeps every core busy, that is not enough: a niced encoder still takes its share of the
cores, and each time it runs it stalls one of the step's parallel threads and with it the whole
step (mid-size model, 2 quiet cores, benchmarks/publish_overlap.py: 0.83-0.87x of the steps/s with
publishing off, whether inline, in a thread, or in a process at nice 10 or 19). `idle` runs the versions' encoding
process at idle priority (Linux's SCHED_IDLE): only on CPU time training leaves, never
preempting it. The steps then ran at 0.90-0.975x of off (four runs), and 40% of the versions were
skipped (their change carried by the next delta): the publisher keeps up with what training
leaves it. What was left was the learner's own share: a fresh host copy of each version (a page
fault per page) copied again into shared memory by this thread, and the delta and undo delta
unpickled from the pipe, 0.17 CPU seconds a version; with the version cast straight into reused
shared memory (`copy_state`) and the deltas read from a file (payload_files.py), 0.08, and the
steps ran at 0.944-1.053x of off (six runs, median 0.989x), half the versions skipped. A learner
waiting for rollouts leaves it all it needs. A thread is never idle: one holding the GIL and then
held off its core would stall the training thread that waits for the GIL.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Literal, Mapping

import torch

from swarm.fabric.weights.encoder_process import (BlockPool, EncoderDied, EncoderProcess, NoSharedMemory, SharedState,
                                                  SharedTensors)

logger = logging.getLogger(__name__)

PUBLISHER_NICE = 10  # CFS gives a nice-10 thread about a tenth of a contended core beside a nice-0 one
ISOLATIONS = ("thread", "process")


class PublisherFailed(RuntimeError):
    """The publisher's thread failed: no version after the last published one will be published."""


class OnDevice:
    """A snapshot whose tensors are (some of them) on a CUDA device, with an event recorded on the
    submitting thread's stream after the kernels that made them."""

    def __init__(self, state: Mapping[str, torch.Tensor], device: torch.device) -> None:
        self.state, self.device = state, device
        self.ready = torch.cuda.Event()
        self.ready.record(torch.cuda.current_stream(device))

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor]):
        device = next((t.device for t in state.values() if t.is_cuda), None)
        return state if device is None else cls(state, device)

    def on_host(self) -> dict[str, torch.Tensor]:
        """The tensors on the CPU. The copies run on a stream of this thread's own, after the event:
        on the default stream they would queue with the training thread's kernels and hold its next
        step up; pageable host memory, since the store keeps these for as long as the version is held
        (the copy is synchronous for this thread alone: torch releases the GIL while it runs)."""
        stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            stream.wait_event(self.ready)
            host = {k: v.to("cpu") for k, v in self.state.items()}
        stream.synchronize()
        self.state = {}  # the device copies are freed once the copies are done
        return host

    def to_shared(self, pool: BlockPool | None = None) -> SharedState:
        """The tensors copied straight into one block of shared memory (for an encoding process), on
        a stream of this thread's own as `on_host` does."""
        shared = SharedState.allocate(self.state, pool)
        stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            stream.wait_event(self.ready)
            for name, view in shared.tensors.items():
                view.copy_(self.state[name])
        stream.synchronize()
        self.state = {}
        return shared


class Publisher:
    """Publishes versions of `store` (a VersionStore) from its own thread, a queue of one.

    on_published(version, digest): called (from the publisher's thread, or the caller's for
    `publish_now`) once a version is held and hashed. on_encoding(version, base): called before a
    version's delta from `base` (None: no version held yet) is encoded. nice: the thread's
    scheduling niceness (0: as the caller's). encode_delay_s: added to every publication (tests and
    benchmarks: a learner whose encoding is slower than its step). isolation: where the encoding
    runs, "thread" (here) or "process" (a process of its own, started now: `encoder_pid`). idle:
    the process encoding every version runs at idle priority (a CPU learner's: see above); the one
    encoding snapshots does not, since a joining sampler waits for what it encodes."""

    def __init__(self, store, *, on_published: Callable[[int, str], None],
                 on_encoding: Callable[[int, int | None], None] | None = None, nice: int = PUBLISHER_NICE,
                 encode_delay_s: float = 0.0, name: str = "version-publisher",
                 isolation: Literal["thread", "process"] = "thread", idle: bool = False) -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {', '.join(ISOLATIONS)}, not {isolation!r}")
        self.store, self.on_published, self.on_encoding = store, on_published, on_encoding
        self.nice, self.encode_delay_s, self.isolation = nice, encode_delay_s, isolation
        # started first: the child imports torch and the codec while the caller gets its first version ready
        self._encoder = EncoderProcess(nice=nice, idle=idle, name=f"{name}-encoder") if isolation == "process" else None
        self._blocks = BlockPool()  # the shared memory of versions the store no longer holds whole, reused
        self._cond = threading.Condition()
        self._waiting: tuple[int, Mapping[str, torch.Tensor]] | None = None
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self.submitted = self.published = 0
        self.skipped: list[int] = []  # versions replaced while waiting (their change is carried by the next)
        self.busy_seconds = 0.0  # spent publishing
        self._last: tuple[int, SharedState] | None = None  # the version published last and its shared block
        self._name = name
        self._snapshots: EncoderProcess | None = None  # encodes snapshots for the store; started at the first
        self._snapshots_lock = threading.Lock()
        self.snapshots_encoded = 0  # snapshots encoded in that process
        if self._encoder is not None:
            store.snapshot_encoder = self._snapshot
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def copy_state(self, live: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> Mapping[str, torch.Tensor]:
        """A snapshot of `live` (the model's own tensors, views: the next step changes them) for
        `submit`, floating-point tensors cast to `dtype`, made in the calling thread. CUDA tensors:
        a cast copy where they are (the publisher's thread takes it to the host). CPU tensors,
        encoded in a process: cast straight into a block of shared memory reused from an earlier
        version (a fresh host copy costs a page fault per 4 KiB page, ~50 ms a version at the
        mid-size model, then the publisher's thread copied it into shared memory again: two copies
        of CPU time a CPU learner's step wanted, where this is one). Else a host copy."""
        if self._encoder is not None and not any(t.is_cuda for t in live.values()):
            try:
                return SharedTensors(SharedState.copy_of(live, self._blocks, dtype))
            except NoSharedMemory:
                pass  # (the publisher's thread finds the same, and moves to encoding in a thread)
        return {k: v.detach().to(None, dtype if dtype is not None and v.is_floating_point() else v.dtype, copy=True)
                for k, v in live.items()}

    def submit(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        """Has `version` published in the background; `state` is the publisher's from now on (a
        snapshot nothing else changes, as `copy_state` makes; CUDA tensors are taken to the host in
        the publisher's thread). A version still waiting is replaced (skipped). Raises
        PublisherFailed when the thread failed."""
        state = state.shared if isinstance(state, SharedTensors) else OnDevice.of(state)
        with self._cond:
            self._check()
            if self._closed:
                raise PublisherFailed("the publisher is closed")
            if self._waiting is not None:
                self.skipped.append(self._waiting[0])
            self._waiting = (version, state)
            self.submitted += 1
            self._cond.notify_all()

    def publish_now(self, version: int, state: Mapping[str, torch.Tensor]) -> str:
        """Publishes `version` in the caller's thread, once everything submitted before it is done
        (a learner's first version, announced before anything else happens; inline publishing)."""
        state = state.shared if isinstance(state, SharedTensors) else OnDevice.of(state)
        self.wait()
        with self._cond:
            self._busy = True
            self.submitted += 1
        try:
            return self._publish(version, state)
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Until nothing waits or is being published (False: `timeout` seconds passed first).
        Raises PublisherFailed when the thread failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (self._waiting is not None or self._busy) and self._error is None and not self._closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            self._check()
            return True

    @property
    def failed(self) -> BaseException | None:
        return self._error

    @property
    def blocks_reused(self) -> int:
        """How many versions were copied into shared memory an earlier version had (isolation "process")."""
        return self._blocks.reused

    @property
    def encoder_pid(self) -> int | None:
        """The encoding process's id (isolation "process"), else None."""
        return None if self._encoder is None else self._encoder.pid

    @property
    def snapshot_encoder_pid(self) -> int | None:
        """The process encoding snapshots for the store, once started (isolation "process"), else None."""
        return None if self._snapshots is None else self._snapshots.pid

    def close(self) -> None:
        """Stops the thread: a version waiting is dropped, one being published is finished first;
        then the encoding processes (if any) leave, or are killed."""
        with self._cond:
            self._closed = True
            self._waiting = None
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
        if self._encoder is not None:
            self._encoder.stop()
        with self._snapshots_lock:  # (after a snapshot under way)
            if self._snapshots is not None:
                self._snapshots.stop()

    def _check(self) -> None:
        if self._error is not None:
            raise PublisherFailed(f"publishing failed ({type(self._error).__name__}: {self._error}); "
                                  f"the last version published is {self.store.latest}") from self._error

    def _run(self) -> None:
        if self.nice and hasattr(os, "setpriority"):
            try:  # Linux: the thread's own id, which the codec's worker threads inherit the niceness of
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except OSError as exc:
                logger.info("publisher runs at normal priority (%s)", exc)
        while True:
            with self._cond:
                while self._waiting is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                version, state = self._waiting
                self._waiting, self._busy = None, True
            try:
                self._publish(version, state)
            except BaseException as exc:  # noqa: BLE001  kept, and raised in the training thread
                logger.error("publishing version %d failed: %s: %s", version, type(exc).__name__, exc)
                with self._cond:
                    self._error, self._busy = exc, False
                    self._cond.notify_all()
                if self._encoder is not None:  # it holds a state's memory, and will never be asked again
                    self._encoder.stop()
                return
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _publish(self, version: int, state) -> str:
        started = time.perf_counter()
        if self._encoder is not None and not isinstance(state, SharedState):  # (the delay is the encoding process's)
            try:
                state = state.to_shared(self._blocks) if isinstance(state, OnDevice) else SharedState.copy_of(state, self._blocks)
            except NoSharedMemory as exc:  # a small /dev/shm (a container's): encode here, as the thread mode does
                logger.warning("%s; publishing from a thread of the learner instead (publish_isolation = \"thread\")", exc)
                self._encoder.stop()
                self._encoder, self.isolation = None, "thread"
        if self._encoder is None:
            state = state.on_host() if isinstance(state, OnDevice) else state.tensors if isinstance(state, SharedState) else state
            if self.encode_delay_s:
                time.sleep(self.encode_delay_s)
        latest = self.store.latest
        if latest is not None and version <= latest:
            # a learner that downloaded the run's state at a version it had published already: the
            # samplers hold that number under its first hash, and the next version's delta starts there
            logger.info("version %d is published already (newest %d): not published again", version, latest)
            return self.store.hashes[latest]
        if self.on_encoding is not None:
            self.on_encoding(version, self.store.latest)
        digest = self.store.add(version, state, owned=True) if self._encoder is None else self._add_encoded(version, state)
        self.on_published(version, digest)
        self.published += 1
        self.busy_seconds += time.perf_counter() - started
        return digest

    def _snapshot(self, version: int) -> bytes | None:
        """The snapshot of `version` encoded in the snapshot-encoding process (started now if not
        yet), when it was the version published last through the encoding process; None: the store
        encodes it itself (another version, closed, the process gone or failed)."""
        last = self._last
        if self._encoder is None or last is None or last[0] != version:
            return None
        with self._snapshots_lock:  # one snapshot at a time: the store asks from its server's and heartbeat's threads
            if self._closed:
                return None
            try:
                if self._snapshots is None:
                    # never idle: a joining sampler waits for it, and it runs once per version asked for
                    self._snapshots = EncoderProcess(nice=self.nice, name=f"{self._name}-snapshots")
                payload = self._snapshots.snapshot(version, last[1])
            except Exception as exc:  # noqa: BLE001  the store encodes it itself
                logger.warning("the snapshot of version %d could not be encoded in a process (%s: %s); encoding it here",
                               version, type(exc).__name__, exc)
                if isinstance(exc, EncoderDied):
                    self._snapshots = None  # (a fresh one at the next snapshot)
                return None
        self.snapshots_encoded += 1
        return payload

    def _add_encoded(self, version: int, shared: SharedState) -> str:
        """`version` encoded by the encoding process and added to the store as its shared tensors."""
        store = self.store
        with store.lock:
            latest = store.latest
            base = None if latest is None else (latest, store.hashes[latest])
        # the child's base is the last state it encoded; anything else added to the store since is sent
        base_state = SharedState.copy_of(store.state(latest)) if base is not None and self._encoder.holds != base else None
        encoded = self._encoder.encode(version, shared, base=base, base_state=base_state, delay_s=self.encode_delay_s,
                                       undo=base is not None and store.whole_states == 1)
        if store.latest != latest:  # another version was added meanwhile: the store encodes from it
            digest = store.add(version, shared.tensors, digest=encoded.digest, owned=True)
        else:
            digest = store.add(version, shared.tensors, delta=encoded.delta, digest=encoded.digest, owned=True,
                               base=latest, undo={latest: encoded.undo} if encoded.undo is not None else None)
        self._last = (version, shared)  # (held by the store as its tensors: the block is not reused meanwhile)
        return digest
