"""LoRA runs with real peers on loopback: a learner and a sampler (in this process, each in its own
thread, over a real bootstrap node: hivemind's DHT and p2p daemons, or the gRPC registry) train an
adapter; the sampler takes the adapter's versions (a snapshot, then deltas), and its model is the
learner's merged one. A sampler whose base model differs is told so and samples nothing."""

import copy
import threading
import time

import pytest
import torch

from swarm.fabric.transports import start_bootstrap
from swarm.runlog import read_jsonl, wait_ready

RUN = "lora-test"


@pytest.fixture(params=["hivemind", "grpc"])
def bootstrap(request):
    node = start_bootstrap(request.param, run_id=RUN, host="127.0.0.1", port=0)
    node.transport = request.param
    try:
        yield node
    finally:
        node.shutdown()


def common(bootstrap, tmp_path, name: str) -> dict:
    return dict(peers=bootstrap.addresses(), transport=bootstrap.transport, run_id=RUN, host="127.0.0.1",
                identity_dir=tmp_path / f"{name}-keys", heartbeat_s=1.0)


def start_learner(bootstrap, tmp_path, steps: int):
    from peers.learner import Learner
    from swarm.config import LearnerConfig

    config = LearnerConfig(**common(bootstrap, tmp_path, "learner"), lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj", "up_proj"],
                           steps=steps, groups_per_step=2, run_dir=tmp_path / "learner", verify_fraction=1.0, wait_s=60,
                           checkpoint_every=0)
    learner = Learner(config, echo=lambda line: None)
    thread = threading.Thread(target=learner.run, name="test-learner", daemon=True)
    thread.start()
    ready = wait_ready(tmp_path / "learner", timeout_s=120, alive=thread.is_alive)
    assert ready is not None, "the learner did not start"
    return learner, thread, ready["learner_key"]


def make_sampler(bootstrap, tmp_path, key: str, **options):
    from peers.sampler import Sampler
    from swarm.config import SamplerConfig

    config = SamplerConfig(**common(bootstrap, tmp_path, "sampler"), learner_keys=[key], prompts_per_round=2, num_generations=4,
                           run_dir=tmp_path / "sampler", **options)
    return Sampler(config, echo=lambda line: None)


def test_a_lora_run_publishes_adapters_that_samplers_apply_to_the_same_base(bootstrap, tmp_path):
    learner, learner_thread, key = start_learner(bootstrap, tmp_path, steps=30)
    sampler = make_sampler(bootstrap, tmp_path, key)
    sampler_thread = threading.Thread(target=sampler.run, name="test-sampler", daemon=True)
    try:
        sampler_thread.start()
        deadline = time.time() + 90
        while (sampler.current or 0) < 3 and time.time() < deadline and sampler_thread.is_alive():
            time.sleep(0.2)
        used = sampler.current
        assert used is not None and used >= 3, f"the sampler is at version {used}"
        # `swarm status` and the dashboard say that the run is a LoRA run, and its r
        from swarm.cli.peer_commands import _adapter
        from swarm.config.learner_keys import decode_learner_key
        from swarm.dashboard.state import announcement_fields

        announced = sampler.fabric.latest_announced([decode_learner_key(key)])
        assert _adapter(announced) == {"lora_r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj", "up_proj", "v_proj"],
                                       "base_hash": learner.adapter.base_hash}
        assert announcement_fields(announced)["lora_r"] == 4
    finally:
        sampler.stop_event.set()
        learner.stop_event.set()
        sampler_thread.join(timeout=60)
        learner_thread.join(timeout=60)
    events = read_jsonl(tmp_path / "sampler" / "events.jsonl")
    adapter = next(e for e in events if e["event"] == "adapter")
    assert (adapter["r"], adapter["alpha"], adapter["target_modules"]) == (4, 8.0, ["q_proj", "up_proj", "v_proj"])
    fetched = [e for e in events if e["event"] == "version_fetched"]
    kinds = [e["kinds"] for e in fetched]
    assert kinds[0] == ["snapshot"], kinds
    # later versions come as the adapter's delta or, where that is no smaller (at a LoRA learning rate
    # every element moves each step: adapter deltas are 0.8-1.0 of the adapter), as its snapshot; the
    # store serves whichever is smaller (VersionStore.payloads), so which one depends on the pace
    assert len(fetched) >= 2 and all(k in (["snapshot"], ["delta"]) or set(k) == {"delta"} for k in kinds), kinds
    assert [e["version"] for e in fetched] == sorted({e["version"] for e in fetched}), fetched
    # a version is the adapter alone: a few KB, where the embedded model's whole state is 3.2 MB
    assert all(e["bytes"] < 100_000 for e in events if e["event"] == "version_fetched")
    steps = read_jsonl(tmp_path / "learner" / "steps.jsonl")
    assert [s["version"] for s in steps][:3] == [1, 2, 3]
    # the learner recomputed every group's log-probs under base + that version's adapter: honest
    assert steps[-1]["verified"] > 0 and steps[-1]["largest_honest_gap"] < 0.01 and not steps[-1]["banned"]
    # the sampler's model is the learner's at that version with its adapter merged in, logit for logit
    from swarm.lora import load_policy_state

    at_version = copy.deepcopy(learner.model)
    load_policy_state(at_version, learner.store.states[used])
    merged = at_version.merge_and_unload().eval()
    ids = torch.tensor([[5, 17, 33, 2, 41, 9]])
    with torch.no_grad():
        theirs = sampler.backend.model(input_ids=ids).logits
        ours = merged(input_ids=ids).logits
        untrained = learner.model.get_base_model()
        with learner.model.disable_adapter():
            untrained = learner.model(input_ids=ids).logits
    assert torch.allclose(theirs, ours, atol=1e-5, rtol=0)
    assert not torch.allclose(ours, untrained, atol=1e-4), "the adapter never moved"
    if bootstrap.transport == "grpc":  # (the quicker transport to start a learner again on)
        resume(bootstrap, tmp_path, learner)


def resume(bootstrap, tmp_path, learner) -> None:
    """A LoRA run's learner resumed from its checkpoint (written at exit) holds the adapter and the
    version it stopped at, and pins the same base."""
    from peers.learner import Learner
    from swarm.fabric.weights.delta import state_hash
    from swarm.lora import is_lora, policy_state

    config = learner.config.model_copy(update={"resume": True})
    resumed = Learner(config, echo=lambda line: None)
    try:
        resumed.setup()
        assert is_lora(resumed.model) and resumed.adapter == learner.adapter
        assert resumed.core.version > learner.core.version or resumed.core.version == learner.core.version
        assert state_hash(policy_state(resumed.model)) == state_hash(policy_state(learner.model))
    finally:
        resumed.stop()


def test_a_sampler_whose_base_model_differs_is_told_and_samples_nothing(bootstrap, tmp_path):
    from peers.sampler import WrongBaseModel
    from swarm.model.loading import load_policy

    other_dir = tmp_path / "other-base"
    model, tokenizer = load_policy("embedded")
    with torch.no_grad():
        model.model.norm.weight.mul_(1.01)  # one tensor of the base differs
    model.save_pretrained(other_dir)
    tokenizer.save_pretrained(other_dir)
    learner, learner_thread, key = start_learner(bootstrap, tmp_path, steps=50)
    try:
        sampler = make_sampler(bootstrap, tmp_path, key, model=str(other_dir))
        with pytest.raises(WrongBaseModel) as caught:
            sampler.run()
    finally:
        learner.stop_event.set()
        learner_thread.join(timeout=60)
    message = str(caught.value)
    announced = learner.adapter.base_hash
    assert announced in message and sampler.backend.base_hash() in message and "--model" in message
    events = read_jsonl(tmp_path / "sampler" / "events.jsonl")
    assert not [e for e in events if e["event"] in ("sent", "version_used")], events
    assert any(e["event"] == "wrong_base_model" and e["announced"] == announced for e in events)
