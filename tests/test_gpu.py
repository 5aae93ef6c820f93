"""GPU paths (marked `gpu`, skipped where no CUDA device exists; never run by this project yet: no
GPU machine was lent to its work): a vLLM sampler against a GPU learner in bfloat16, in-place
partial weight updates checked against the engine, and the learner's view of the log-prob gap."""

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("vllm")
    from swarm.generation import make_backend
    from swarm.model.loading import resolve_model_dir

    return make_backend("vllm", resolve_model_dir("embedded"), dtype="bfloat16", gpu_memory_utilization=0.3)


def sampled_groups(backend, version: int, count: int = 4):
    from swarm.generation import SamplingParams
    from swarm.rewards import RewardScorer
    from swarm.sampling import produce_rollouts
    from swarm.tasks.synthetic import ArithmeticTask

    scorer = RewardScorer()
    try:
        problems = ArithmeticTask(2).problems("train")[:count]
        groups = produce_rollouts(backend, scorer, problems, SamplingParams(num_completions=8, max_new_tokens=16, seed=version),
                                  version=version, sampler_id="gpu")
    finally:
        scorer.close()
    for g in groups:  # an advantage in every group, whatever the policy answered
        g.rewards = [1.0, 0.0] * 4
    return groups


def test_vllm_sampler_against_a_bfloat16_gpu_learner(engine):
    """The learner (float32 master weights, bfloat16 autocast) steps on the engine's groups, publishes
    bfloat16, the engine takes only the changed tensors in place and is checked; groups sampled
    after the swap agree with the learner's log-probs (its fresh gap stays under the alarm)."""
    from peers.sampler import load_version
    from swarm.fabric.versions import VersionStore
    from swarm.model.loading import load_policy
    from swarm.training import LearnerCore

    model, tokenizer = load_policy("embedded", device="cuda", dtype="float32")
    core = LearnerCore(model, tokenizer.pad_token_id, autocast_dtype=torch.bfloat16, learning_rate=1e-3, lr_warmup_steps=0)
    store = VersionStore()

    def publish() -> None:
        store.add(core.version, {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()})

    publish()
    engine.load_state_dict(store.states[0])
    for _ in range(2):
        metrics = core.step(sampled_groups(engine, core.version))
        assert metrics["fresh_logprob_gap"] < 0.05, metrics["fresh_logprob_gap"]
        publish()
        load_version(engine, store.states[core.version], store.states[core.version - 1])  # raises if it did not take


def test_a_partial_update_that_does_not_take_is_caught(engine):
    from swarm.model.loading import load_policy

    model, _ = load_policy("embedded", dtype="bfloat16")
    held = {k: v.clone() for k, v in model.state_dict().items()}
    engine.load_state_dict(held)
    changed = {name: t + 0.01 for name, t in list(held.items())[:2]}
    wrong_previous = copy.deepcopy(held)
    for name in changed:  # claims the engine held something else before: the sums cannot match
        wrong_previous[name] = wrong_previous[name] - 1.0
    with pytest.raises(RuntimeError, match="did not take"):
        engine.load_state_dict(changed, previous=wrong_previous)
