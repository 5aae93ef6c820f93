"""The files through which a publisher's encoding process (encoder_process.py) hands a version's
payloads back to the learner: a tmpfs (memory), read with one read() per piece, the GIL released.
Through the pipe, the parent's side of a delta and undo delta took ~80 ms of a nice-10 thread per
version at the mid-size model (~30 MB: 64 KiB reads into a growing buffer, then unpickling copies
the bytes again), CPU a CPU learner's step wanted; a snapshot's 300 MB through it had the training
thread step 2.7x slower on a busy 2-core machine (benchmarks/snapshot_offload.py).

Each file is named gepo-<kind>-<learner pid>-<child pid>-<version>, removed once read, or by the
next learner to start an encoding process should this one be killed first (`sweep_orphans`).
"""

from __future__ import annotations

import os

from swarm.fabric.weights.undo import UndoDelta

SNAPSHOT_DIR = "/dev/shm"  # where the child leaves payloads for the parent to read (a tmpfs: memory)


class EncoderError(RuntimeError):
    """The encoding process raised an exception that could not be sent back as itself, or handed
    back a payload file that is not what it said."""


def shared_memory_free(path: str = "/dev/shm") -> int | None:
    """Bytes free in the shared-memory file system; None where it cannot be read."""
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def payload_path(kind: str, child_pid: int | None, version: int) -> str:
    """Where the encoding process `child_pid` of this learner leaves `kind` ("delta", "snapshot") of `version`."""
    return os.path.join(SNAPSHOT_DIR, f"gepo-{kind}-{os.getpid()}-{child_pid}-{version}")


def carried(path: str | None, delta: bytes | None, undo: UndoDelta | None) -> tuple:
    """How the child hands a version's delta and undo delta back: their bytes written one after
    another to `path` (a tmpfs), with what the parent needs to cut them apart (`received`); or, where
    that file cannot be written (no room), the objects themselves, through the pipe."""
    pieces = [piece for _, _, gaps, steps in (undo.tensors if undo else ()) for piece in (gaps, steps)]
    blobs = ([] if delta is None else [delta]) + pieces
    if path is None or not blobs:
        return ("inline", delta, undo)
    free = shared_memory_free(os.path.dirname(path))
    if free is not None and free < sum(map(len, blobs)):  # (a tmpfs takes a file past its room: SIGBUS)
        return ("inline", delta, undo)
    try:
        with open(path, "wb") as f:
            for blob in blobs:
                f.write(blob)
    except OSError:
        remove(path)
        return ("inline", delta, undo)
    head = None if undo is None else (undo.version, undo.version_hash, undo.newer, undo.newer_hash,
                                      tuple((name, count) for name, count, _, _ in undo.tensors))
    return ("file", path, [len(b) for b in blobs], delta is not None, head)


def _read(f, size: int) -> bytes:
    """`size` bytes of `f` (fewer at its end): one read() returns at most about 2 GiB."""
    parts = []
    while size > 0:
        part = f.read(min(size, 1 << 30))
        if not part:
            break
        parts.append(part)
        size -= len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def received(carried: tuple) -> tuple[bytes | None, UndoDelta | None]:
    """The parent's side of `carried`: the delta and the undo delta (the file removed)."""
    if carried[0] == "inline":
        return carried[1], carried[2]
    _, path, lengths, has_delta, head = carried
    try:
        with open(path, "rb", buffering=0) as f:
            blobs = [_read(f, n) for n in lengths]
    finally:
        remove(path)
    if [len(b) for b in blobs] != lengths:
        raise EncoderError(f"the encoding process's {path} holds {sum(map(len, blobs))} bytes, not {sum(lengths)}")
    delta = blobs.pop(0) if has_delta else None
    undo = None if head is None else UndoDelta(*head[:4], tuple((name, count, blobs[2 * i], blobs[2 * i + 1])
                                                                for i, (name, count) in enumerate(head[4])))
    return delta, undo


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's)
        return True
    return True


def sweep_orphans() -> None:
    """Removes the payload files (gepo-delta-*, gepo-snapshot-*: `carried`, EncoderProcess.snapshot) a learner
    left in SNAPSHOT_DIR when it was killed between a child's writing one and its own reading it
    (memory, in a tmpfs, until the machine restarts: ~44 MB a version at Qwen3-0.6B shape, more for a
    snapshot): those whose learner, the pid in their name, no longer runs."""
    try:
        names = os.listdir(SNAPSHOT_DIR)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) == 5 and parts[0] == "gepo" and parts[1] in ("delta", "snapshot") and parts[2].isdigit() \
                and not _alive(int(parts[2])):
            try:
                os.unlink(os.path.join(SNAPSHOT_DIR, name))
            except OSError:  # (gone meanwhile, or another user's)
                pass


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
