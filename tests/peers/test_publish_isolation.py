"""Where a learner encodes its versions by default: a process of its own on a GPU, and on a CPU for
a large model (at idle priority there, so that it takes only the CPU time training leaves); the
learner's thread for a small model on a CPU. And an idle publisher's encoding process really runs
at idle priority, publishing what the store would encode (its snapshots' process does not)."""

import os

import pytest
import torch

from peers.learner_setup import PROCESS_MIN_BYTES, publish_isolation
from swarm.config import LearnerConfig
from swarm.fabric.weights.publisher import Publisher
from swarm.fabric.weights.versions import VersionStore


def test_auto_encodes_in_a_process_on_a_gpu_and_for_a_large_cpu_model_at_idle_priority_else_in_the_thread():
    assert LearnerConfig.model_fields["publish_isolation"].default == "auto"
    big, small = PROCESS_MIN_BYTES, PROCESS_MIN_BYTES - 1
    assert publish_isolation("auto", torch.device("cuda", 0), small) == ("process", False)  # the host's cores are idle
    assert publish_isolation("auto", torch.device("cpu"), big) == ("process", True)
    assert publish_isolation("auto", torch.device("cpu"), small) == ("thread", False)
    assert publish_isolation("process", torch.device("cpu"), small) == ("process", True)
    assert publish_isolation("thread", "cuda", big) == ("thread", False)
    assert publish_isolation("thread", "cpu", big) == ("thread", False)  # a thread holding the GIL is never idle


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_an_idle_publishers_encoding_process_runs_at_idle_priority_and_publishes_the_same_versions():
    torch.manual_seed(0)
    first = {"w": torch.randn(256, 64).to(torch.bfloat16)}
    second = {"w": first["w"].clone()}
    second["w"][:3] += 1
    stores = {idle: VersionStore(capacity=4, whole_states=1) for idle in (False, True)}
    for idle, store in stores.items():
        publisher = Publisher(store, on_published=lambda v, d: None, isolation="process", idle=idle)
        try:
            publisher.publish_now(0, {k: v.clone() for k, v in first.items()})
            publisher.submit(1, {k: v.clone() for k, v in second.items()})
            assert publisher.wait(timeout=60) and store.latest == 1
            # (asked once the child has encoded: it sets its priority as it starts)
            assert os.sched_getscheduler(publisher.encoder_pid) == (os.SCHED_IDLE if idle else os.SCHED_OTHER)
            store.payload("snapshot", 1)  # encoded by the snapshots' process, started now
            # never idle: a joining sampler waits for the snapshot it encodes
            assert os.sched_getscheduler(publisher.snapshot_encoder_pid) == os.SCHED_OTHER
        finally:
            publisher.close()
    assert stores[True].hashes == stores[False].hashes and stores[True].deltas == stores[False].deltas
