"""Every registered loss trains a real (tiny) transformers causal LM: finite loss, parameters move."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from swarm.advantages import group_advantages
from swarm.logprobs import completion_logprobs
from swarm.losses import LOSSES, LossConfig, LossInputs, compute_loss


def tiny_lm():
    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, pad_token_id=0,
    )
    return Qwen3ForCausalLM(config)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_one_optimizer_step_per_loss(name):
    torch.manual_seed(0)
    model = tiny_lm()
    b, tp, tc = 8, 5, 7
    prompt_ids = torch.randint(1, 64, (b, tp))
    prompt_mask = torch.ones(b, tp, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    completion_ids = torch.randint(1, 64, (b, tc))
    completion_mask = torch.ones(b, tc)
    completion_mask[3, 4:] = 0  # right padding
    with torch.no_grad():
        sampler = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        sampler = sampler + 0.3 * torch.randn_like(sampler)  # a stale sampler
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, float("nan")])
    spec = LOSSES[name]
    adv = group_advantages(rewards, groups, spec.advantage_mode)

    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    learner = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    out = compute_loss(LossInputs(learner, sampler, completion_mask, adv, groups), LossConfig(name=name))
    out.loss.backward()
    optimizer.step()

    assert torch.isfinite(out.loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    changed = sum(not torch.equal(p0, p1.detach()) for p0, p1 in zip(before, model.parameters()))
    assert changed >= len(before) // 2, f"{name}: only {changed}/{len(before)} tensors changed"


def test_learner_core_steps_on_generated_rollouts_and_counts_staleness():
    from swarm.generation import SamplingParams
    from swarm.generation.transformers_backend import TransformersBackend
    from swarm.model.loading import load_policy
    from swarm.rewards import RewardScorer
    from swarm.sampling import produce_rollouts
    from swarm.tasks.synthetic import ArithmeticTask
    from swarm.training import LearnerCore

    model, tokenizer = load_policy("embedded")
    backend = TransformersBackend(model, tokenizer)
    problems = ArithmeticTask(2).problems("train")[:4]
    groups = produce_rollouts(backend, RewardScorer(), problems, SamplingParams(num_completions=4, max_new_tokens=12, seed=0),
                              version=0, sampler_id="test")
    assert [g.problem_id for g in groups] == [p.problem_id for p in problems]
    assert all(len(g.rewards) == 4 and all(r in (0.0, 1.0) for r in g.rewards) for g in groups)
    learner = LearnerCore(model, tokenizer.pad_token_id, learning_rate=1e-3, micro_batch_groups=3, version=3)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = learner.step(groups)
    assert learner.version == 4
    assert metrics["staleness_mean"] == 3.0 and metrics["staleness_max"] == 3.0
    assert abs(metrics["kl_sampler_learner"]) < 1e-4  # fresh rollouts: sampler == learner
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="at least one rollout group"):
        learner.step([])
