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


def test_a_learner_publishing_from_its_encoding_process_is_followed_by_a_sampler_bit_for_bit(tmp_path):
    """A real learner (`--publish-isolation process`: its versions cast straight into shared memory,
    their deltas handed back in files) and a real sampler over the gRPC registry on loopback: the
    sampler takes the learner's versions as it goes and holds them bit for bit. (The tiny model's
    steps move so much of it that a sampler behind is sent snapshots; test_publisher_process.py
    checks the deltas byte for byte.)"""
    import threading
    import time

    from peers.learner import Learner
    from peers.sampler import Sampler
    from swarm.config import SamplerConfig
    from swarm.fabric.transports import start_bootstrap
    from swarm.fabric.weights.delta import state_hash
    from swarm.runlog import read_jsonl, wait_ready

    node = start_bootstrap("grpc", run_id="isolation-test", host="127.0.0.1", port=0)
    common = dict(peers=node.addresses(), transport="grpc", run_id="isolation-test", host="127.0.0.1", heartbeat_s=1.0)
    learner = Learner(LearnerConfig(**common, identity_dir=tmp_path / "learner-keys", steps=100_000, groups_per_step=2,
                                    run_dir=tmp_path / "learner", wait_s=60, checkpoint_every=0,
                                    publish_isolation="process"), echo=lambda line: None)
    threads = [threading.Thread(target=learner.run, name="test-learner", daemon=True)]
    try:
        threads[0].start()
        ready = wait_ready(tmp_path / "learner", timeout_s=120, alive=threads[0].is_alive)
        assert ready is not None, "the learner did not start"
        # ready.json is written once the learner has joined; its publisher starts just after (bounded wait)
        deadline = time.time() + 60
        while learner.publisher is None and time.time() < deadline and threads[0].is_alive():
            time.sleep(0.05)
        assert learner.publisher is not None, "the learner never started publishing"
        assert learner.publisher.isolation == "process" and learner.publisher.encoder_pid is not None
        sampler = Sampler(SamplerConfig(**common, identity_dir=tmp_path / "sampler-keys", learner_keys=[ready["learner_key"]],
                                        prompts_per_round=2, num_generations=4, run_dir=tmp_path / "sampler"),
                          echo=lambda line: None)
        threads.append(threading.Thread(target=sampler.run, name="test-sampler", daemon=True))
        threads[1].start()
        deadline = time.time() + 120  # (the learner steps on until stopped: on a loaded machine, 60 steps on
        # rollouts of version 0 ended the run, and with it the sampler, before it had fetched a later version)
        def held() -> dict:  # (the sampler makes its store as it starts)
            return dict(getattr(getattr(sampler, "store", None), "hashes", {}))
        while max(held(), default=0) < 3 and time.time() < deadline and threads[1].is_alive():
            time.sleep(0.2)
        published = max(held(), default=0)
        assert published >= 3, sorted(held())
        fetched = [e["version"] for e in read_jsonl(tmp_path / "sampler" / "events.jsonl") if e.get("event") == "version_fetched"]
        assert len(fetched) >= 2, fetched  # the first version, and a later one
        with sampler.store.lock:
            held = sampler.store.states[published]
        assert state_hash(held) == sampler.store.hashes[published] == learner.store.hashes[published]
    finally:
        for peer in (learner, *(() if len(threads) < 2 else (sampler,))):
            peer.stop_event.set()
        for thread in threads:
            thread.join(60)
        node.shutdown()
