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
