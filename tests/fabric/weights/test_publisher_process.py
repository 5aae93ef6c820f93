"""The publisher whose encoding runs in a process of its own (isolation="process"): the versions it
publishes are the ones the in-process store would encode, byte for byte (hashes, deltas across
skipped versions, undo deltas); a child that dies or raises fails the publisher with nothing half
published; close() leaves no process behind. Real spawned processes and shared memory."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from swarm.fabric.weights.delta import apply_payload_verified, encode_snapshot, state_hash
from swarm.fabric.weights import payload_files
from swarm.fabric.weights.encoder_process import SharedTensors
from swarm.fabric.weights.publisher import Publisher, PublisherFailed
from swarm.fabric.weights.versions import VersionStore
from tests.fabric.weights.test_held_versions import states

ROOT = Path(__file__).resolve().parents[3]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_encoding_process_publishes_what_the_store_would_encode_byte_for_byte_across_skips():
    store = VersionStore(capacity=16, whole_states=1)
    published, encoding = [], []
    publisher = Publisher(store, on_published=lambda v, d: published.append((v, d)), encode_delay_s=0.15,
                          on_encoding=lambda v, base: encoding.append((v, base)), isolation="process")
    pid = publisher.encoder_pid
    trained = list(states(12, seed=5))
    try:
        publisher.publish_now(0, {k: v.clone() for k, v in trained[0].items()})
        for version in range(1, 10):  # steps faster than the encoding: some versions are skipped
            publisher.submit(version, {k: v.clone() for k, v in trained[version].items()})
            time.sleep(0.03)
        assert publisher.wait(timeout=60)
        # a version added to the store by other means (a learner that downloaded the run's state): the
        # child is sent it as the base of the next delta
        store.add(10, trained[10])
        publisher.submit(11, {k: v.clone() for k, v in trained[11].items()})
        assert publisher.wait(timeout=60)
    finally:
        publisher.close()
    assert gone(pid)
    versions = [v for v, _ in published]
    assert publisher.skipped and versions == sorted(versions) and versions[-1] == 11
    assert len(versions) + len(publisher.skipped) == 11  # 0..9 and 11 published or skipped, once each
    assert [v for v, _ in encoding] == versions and encoding[0] == (0, None)
    assert [base for _, base in encoding] == [None, *versions[:-2], 10]  # each encoded from the newest held
    # the store a thread publisher fills (store.add encodes everything in this process), same versions in order
    reference = VersionStore(capacity=16, whole_states=1)
    for version in sorted(store.hashes):
        reference.add(version, trained[version])
    assert store.hashes == reference.hashes and all(store.hashes[v] == state_hash(trained[v]) for v in store.hashes)
    assert store.deltas == reference.deltas and store.bases == reference.bases  # byte-identical deltas, across the gaps
    assert store._undo == reference._undo  # byte-identical undo deltas
    assert store.bases[11] == 10
    assert publisher.blocks_reused >= 2  # shared memory of versions no longer whole, written again: no version harmed
    for version in store.hashes:  # every held version rebuilds from the shared-memory whole state
        assert state_hash(store.states[version]) == store.hashes[version]
    version, state, digest, kind = apply_payload_verified(store.deltas[11], trained[10])
    assert (version, kind, digest) == (11, "delta", store.hashes[11])


def test_a_child_killed_mid_version_fails_the_publisher_and_nothing_is_half_published():
    store = VersionStore(capacity=4, whole_states=1)
    published = []
    gen = states(3, seed=6)
    publisher = Publisher(store, on_published=lambda v, d: published.append(v), encode_delay_s=1.0, isolation="process")
    pid = publisher.encoder_pid
    try:
        publisher.publish_now(0, next(gen))
        publisher.submit(1, next(gen))
        time.sleep(0.4)  # version 1 is with the child (it sleeps 1 s before encoding)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(PublisherFailed, match=rf"encoding process \(pid {pid}\) was killed by SIGKILL .*version 1"):
            publisher.wait(timeout=30)
        with pytest.raises(PublisherFailed, match="SIGKILL"):
            publisher.submit(2, next(gen))
        assert published == [0] and store.latest == 0 and list(store.hashes) == [0] and not store.deltas
    finally:
        publisher.close()
    assert gone(pid)


def test_the_newest_snapshot_is_encoded_in_the_encoding_process_byte_for_byte_and_here_when_the_child_is_gone():
    store = VersionStore(capacity=4, whole_states=1)
    gen = states(4, seed=7)
    publisher = Publisher(store, on_published=lambda v, d: None, isolation="process")
    pid = publisher.encoder_pid
    try:
        publisher.publish_now(0, next(gen))
        publisher.submit(1, next(gen))
        assert publisher.wait(timeout=60)
        payload = store.payload("snapshot", 1)  # what a new sampler's chunked fetch asks for
        assert publisher.snapshots_encoded == 1
        assert payload == encode_snapshot(store.states[1], 1)  # the bytes this process would have encoded
        version, state, digest, kind = apply_payload_verified(payload)
        assert (version, kind, digest) == (1, "snapshot", store.hashes[1])
        assert store.payload("snapshot", 1) is payload and publisher.snapshots_encoded == 1  # encoded once
        assert store.payloads(None, 0) == [encode_snapshot(store.states[0], 0)]  # not the child's last: encoded here
        assert publisher.snapshots_encoded == 1
        snapshots_pid = publisher.snapshot_encoder_pid
        assert snapshots_pid not in (None, pid)  # a process of its own: a snapshot never holds the next delta back
        # that process gone: the snapshot is encoded here, and publishing goes on
        publisher.submit(2, next(gen))
        assert publisher.wait(timeout=60)
        os.kill(snapshots_pid, signal.SIGKILL)
        publisher._snapshots.process.join(timeout=30)
        assert store.payload("snapshot", 2) == encode_snapshot(store.states[2], 2)
        assert publisher.snapshots_encoded == 1
        publisher.submit(3, next(gen))
        assert publisher.wait(timeout=60) and store.latest == 3
    finally:
        publisher.close()
    assert gone(pid) and gone(snapshots_pid)


def test_an_exception_in_the_child_reaches_the_training_thread_and_close_finishes_the_version_under_way():
    store = VersionStore(capacity=4, whole_states=1)
    first = next(states(1))
    publisher = Publisher(store, on_published=lambda v, d: None, isolation="process")
    pid = publisher.encoder_pid
    try:
        publisher.publish_now(0, first)
        publisher.submit(1, {"embed": first["embed"]})  # other tensor names than version 0: no delta can be encoded
        with pytest.raises(PublisherFailed, match="ValueError: tensor names differ"):
            publisher.wait(timeout=30)
        assert store.latest == 0
    finally:
        publisher.close()
    assert gone(pid)

    store = VersionStore(capacity=8, whole_states=1)
    published = []
    publisher = Publisher(store, on_published=lambda v, d: published.append(v), encode_delay_s=0.5, isolation="process")
    pid = publisher.encoder_pid
    gen = states(3)
    publisher.publish_now(0, next(gen))
    publisher.submit(1, next(gen))
    time.sleep(0.1)  # version 1 is under way
    publisher.submit(2, next(gen))  # waits, and is dropped
    publisher.close()
    assert published == [0, 1] and store.latest == 1 and gone(pid)
    with pytest.raises(PublisherFailed, match="closed"):
        publisher.submit(3, {})


def test_an_unknown_isolation_is_refused():
    with pytest.raises(ValueError, match="isolation must be one of thread, process, not 'fork'"):
        Publisher(VersionStore(), on_published=lambda v, d: None, isolation="fork")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_states_on_the_gpu_are_published_through_shared_memory_as_the_same_versions():
    """CUDA states are copied by the publisher's thread straight into shared memory, on a stream of
    its own after the kernels that made them, while the training thread goes on writing the weights."""
    store = VersionStore(capacity=4, whole_states=1)
    publisher = Publisher(store, on_published=lambda v, d: None, isolation="process")
    pid = publisher.encoder_pid
    trained = list(states(3, seed=3))
    try:
        for version, state in enumerate(trained):
            weights = {k: v.cuda() for k, v in state.items()}
            publisher.submit(version, {k: v.clone() for k, v in weights.items()})
            for v in weights.values():
                v.add_(1)  # the next step, on the default stream
            assert publisher.wait(timeout=60)
            assert store.hashes[version] == state_hash(state)
        version, state, digest, kind = apply_payload_verified(store.deltas[2], trained[1])
        assert (version, kind, digest) == (2, "delta", store.hashes[2])
    finally:
        publisher.close()
    assert gone(pid)


def test_the_store_takes_a_precomputed_undo_delta_only_where_it_pairs_the_versions_it_demotes():
    trained = list(states(3, seed=7))
    reference = VersionStore(capacity=4, whole_states=1)
    for version, state in enumerate(trained):
        reference.add(version, state)
    wrong = reference._undo[0]  # 1 -> 0: handed over as if it took 2 back to 1
    store = VersionStore(capacity=4, whole_states=1)
    store.add(0, trained[0])
    store.add(1, trained[1], undo={0: reference._undo[0]})
    assert store._undo[0] is reference._undo[0]  # used as given: it pairs 1 -> 0
    store.add(2, trained[2], undo={1: wrong})
    assert store._undo[1] == reference._undo[1] and store._undo[1] is not wrong  # not paired: encoded here
    assert state_hash(store.state(0)) == store.hashes[0]


def _leftover_files(*pids) -> list[str]:
    return [name for name in os.listdir("/dev/shm")
            if name.startswith("gepo-delta-") and any(f"-{pid}-" in name for pid in pids)]


@pytest.mark.parametrize("through", ["file", "pipe"])
def test_a_learners_weights_are_cast_straight_into_reused_shared_memory_and_published_as_the_store_would(through, monkeypatch):
    """copy_state: the model's float32 tensors cast to bfloat16 in the calling thread, straight into a
    block of shared memory an earlier version had (no host copy, and none in the publisher's thread);
    the deltas and undo deltas come back through a file in /dev/shm that is removed once read, or,
    where the child cannot write it there, through the pipe: the same bytes either way."""
    if through == "pipe":  # the child is handed a path it cannot write
        monkeypatch.setattr(payload_files, "SNAPSHOT_DIR", "/nonexistent-gepo-dir")
    trained = [{k: v.float() for k, v in state.items()} for state in states(6, seed=11)]  # master weights
    store = VersionStore(capacity=8, whole_states=1)
    publisher = Publisher(store, on_published=lambda v, d: None, isolation="process")
    thread_side = Publisher(VersionStore(capacity=8), on_published=lambda v, d: None)
    pids = (os.getpid(), publisher.encoder_pid)
    try:
        assert type(thread_side.copy_state(trained[0], torch.bfloat16)) is dict  # encoded in a thread: a host copy
        live = {k: v.clone() for k, v in trained[0].items()}
        first = publisher.copy_state(live, torch.bfloat16)
        assert isinstance(first, SharedTensors) and all(t.dtype == torch.bfloat16 for t in first.values())
        publisher.publish_now(0, first)
        for version in range(1, 6):
            for name, t in live.items():  # the next step changes the model's own tensors in place
                t.copy_(trained[version][name])
            publisher.submit(version, publisher.copy_state(live, torch.bfloat16))
            assert publisher.wait(timeout=60)
    finally:
        publisher.close()
        thread_side.close()
    reference = VersionStore(capacity=8, whole_states=1)
    for version in range(6):
        reference.add(version, {k: v.to(torch.bfloat16) for k, v in trained[version].items()})
    assert store.hashes == reference.hashes and store.deltas == reference.deltas and store._undo == reference._undo
    assert publisher.blocks_reused >= 3  # each version cast into the block of one the store let go
    assert _leftover_files(*pids) == []


def test_a_block_whose_version_waits_or_is_being_encoded_is_never_cast_into_again():
    """copy_state takes shared memory from the pool on the training thread, while the child may still
    be encoding an earlier version from another block and a third version waits: a block is held by
    its SharedState alone (the views of it dropped), and never handed out again until let go. Handed
    out as the pool's own tensor, the block being encoded looked free and the next version was cast
    into it under the child (a torn digest and delta)."""
    trained = [{k: v.float() for k, v in state.items()} for state in states(6, seed=13)]
    store = VersionStore(capacity=8, whole_states=1)
    publisher = Publisher(store, on_published=lambda v, d: None, isolation="process", encode_delay_s=0.4)
    blocks = {}
    try:
        publisher.publish_now(0, publisher.copy_state(trained[0], torch.bfloat16))
        for version in range(1, 6):  # steps faster than the encoding: versions wait, and are skipped
            state = publisher.copy_state(trained[version], torch.bfloat16)
            blocks[version] = state.shared.block.data_ptr()
            publisher.submit(version, state)
            del state  # as Learner.publish leaves it: only the publisher holds the version now
            time.sleep(0.05)
        assert publisher.wait(timeout=60)
    finally:
        publisher.close()
    assert blocks[2] != blocks[1]  # version 1 was being encoded when version 2 was cast
    assert publisher.skipped and store.latest == 5
    for version in store.hashes:  # each what was trained, bit for bit
        assert store.hashes[version] == state_hash({k: v.to(torch.bfloat16) for k, v in trained[version].items()}), version
        assert state_hash(store.states[version]) == store.hashes[version], version


def test_payload_files_a_killed_learner_left_are_removed_by_the_next_encoding_process():
    gone_learner = subprocess.Popen([sys.executable, "-c", "pass"])
    gone_learner.wait(timeout=30)
    left = Path(payload_files.SNAPSHOT_DIR) / f"gepo-delta-{gone_learner.pid}-1-7"
    ours = Path(payload_files.payload_path("snapshot", 1, 7))  # this learner's, still to be read
    left.write_bytes(b"x" * 1000)
    ours.write_bytes(b"y")
    try:
        publisher = Publisher(VersionStore(capacity=4, whole_states=1), on_published=lambda v, d: None, isolation="process")
        publisher.close()
        assert not left.exists() and ours.exists()
    finally:
        for path in (left, ours):
            path.unlink(missing_ok=True)


SMALL_SHM_SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
from swarm.fabric.weights.delta import state_hash
from swarm.fabric.weights.publisher import Publisher
from swarm.fabric.weights.versions import VersionStore
from tests.fabric.weights.test_held_versions import states
store = VersionStore(capacity=4, whole_states=1)
publisher = Publisher(store, on_published=lambda v, d: None, isolation="process")
try:
    for version, state in enumerate(states(3, seed=2)):
        # as a learner hands them: copy_state finds no room either, and makes a copy on the host
        publisher.submit(version, publisher.copy_state(state))
        publisher.wait(timeout=120)
        assert store.hashes[version] == state_hash(state), version
    print("ISOLATION", publisher.isolation, "ENCODER", publisher.encoder_pid)
finally:
    publisher.close()
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare for a mount namespace")
def test_a_shared_memory_too_small_for_a_version_falls_back_to_the_thread_with_a_warning(tmp_path):
    """A container's /dev/shm (Docker's default is 64 MB) has no room for a version: a real 64 KB tmpfs
    mounted over /dev/shm in a mount namespace of the test's own. The publisher says so and encodes in
    its thread (a tmpfs takes a file larger than its room, and writes past it would SIGBUS the learner)."""
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=64k tmpfs /dev/shm"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:  # a container without the right to mount: nothing of the publisher is tried
        pytest.skip(f"cannot mount a tmpfs in a mount namespace here: {probe.stderr.strip()[:200]}")
    script = tmp_path / "small_shm.py"
    script.write_text(SMALL_SHM_SCRIPT)
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          f"mount -t tmpfs -o size=64k tmpfs /dev/shm && exec {sys.executable} {script}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=180, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:])
    assert "no room for a version" in out.stdout and "publishing from a thread" in out.stdout, out.stdout[-2000:]
    assert "ISOLATION thread ENCODER None" in out.stdout, out.stdout[-2000:]
