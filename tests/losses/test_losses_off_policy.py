"""The objectives for stale rollouts (swarm/losses/off_policy.py), worked by hand where their masks,
caps and clips act: M2PO, AReaL's decoupled PPO, token-TIS with seq-MIS, DeepSeek-V3.2's OPSM."""

import math

import pytest
import torch

from swarm.losses import LossConfig, LossInputs, clip_range, compute_loss

E = math.exp


def batch(log_ratios, advantages, proximal=None):
    """Sequences of the given token log-ratios l - s (the sampler at log-prob -1, right-padded), one
    prompt. Returns the learner log-probs (which carry the gradient), the inputs and the mask."""
    width = max(len(r) for r in log_ratios)
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in log_ratios])
    ratios = torch.tensor([list(r) + [0.0] * (width - len(r)) for r in log_ratios])
    sampler = torch.full_like(ratios, -1.0)
    learner = (sampler + ratios).requires_grad_(True)
    prox = None if proximal is None else sampler + torch.tensor(proximal)
    inputs = LossInputs(learner, sampler, mask, torch.tensor(advantages), torch.zeros(len(log_ratios), dtype=torch.long),
                        proximal_logprobs=prox)
    return learner, inputs, mask


def loss_and_grad(inputs, learner, **config):
    out = compute_loss(inputs, LossConfig(kl_coef=0, **config))
    (grad,) = torch.autograd.grad(out.loss, learner)
    return out, grad


def test_m2po_masks_the_largest_trust_region_tokens_until_the_second_moment_is_within_budget():
    # A > 0: log r = (0.5, 0.1, -0.3, 0.2); A < 0: (-0.4, 0.3). Trust-region tokens (a PPO clip would
    # act on them): A > 0 with r > 1 -> 0.5, 0.1, 0.2; A < 0 with r < 1 -> -0.4. Squares 0.25, 0.01,
    # 0.04, 0.16: mean 0.115 > 0.04, mask 0.5 -> mean 0.07 > 0.04, mask -0.4 -> mean 0.025: stop.
    learner, inputs, mask = batch([[0.5, 0.1, -0.3, 0.2], [-0.4, 0.3]], [1.0, -1.0])
    out, grad = loss_and_grad(inputs, learner, name="m2po")
    kept = E(0.1) + E(-0.3) + E(0.2) - E(0.3)  # sum of M * r * A over the 6 tokens
    assert out.loss.item() == pytest.approx(-kept / 6, abs=1e-6)
    assert out.metrics["m2"].item() == pytest.approx(0.115, abs=1e-6)
    assert out.metrics["clip_frac"].item() == pytest.approx(2 / 6)
    # masked tokens carry no gradient; the rest d(-M r A / 6)/dl = -r A / 6 (no clip)
    expected = torch.tensor([[0.0, -E(0.1), -E(-0.3), -E(0.2)], [0.0, E(0.3), 0.0, 0.0]]) / 6
    assert torch.allclose(grad, expected, atol=1e-6)
    # a larger budget masks nothing
    out = compute_loss(inputs, LossConfig(name="m2po", kl_coef=0, m2po_threshold=0.2))
    assert out.loss.item() == pytest.approx(-(E(0.5) + E(0.1) + E(-0.3) + E(0.2) - E(-0.4) - E(0.3)) / 6, abs=1e-6)
    assert out.metrics["clip_frac"].item() == 0.0


def test_m2po_masks_the_whole_trust_region_when_no_remainder_is_within_budget():
    # One trust-region token with (log r)^2 = 0.25 > 0.04: masked; the A < 0, r > 1 token is not in T.
    learner, inputs, _ = batch([[0.5], [0.5]], [1.0, -1.0])
    out, grad = loss_and_grad(inputs, learner, name="m2po")
    assert out.loss.item() == pytest.approx(E(0.5) / 2, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[0.0], [E(0.5) / 2]]), atol=1e-6)


def test_decoupled_ppo_in_the_swarm_is_the_behaviour_weighted_gradient_with_the_cap():
    # No proximal log-probs given: pi_prox is the learner itself, so pi/pi_prox = 1 and the clip is
    # inert. Behaviour weights exp(l - s): A > 0 tokens 2 and 6 (6 > 5: left out), A < 0 token 0.5.
    learner, inputs, _ = batch([[math.log(2), math.log(6)], [math.log(0.5)]], [1.0, -1.0])
    out, grad = loss_and_grad(inputs, learner, name="decoupled_ppo")
    assert out.loss.item() == pytest.approx(-(2 * 1 - 0.5) / 3, abs=1e-6)  # token mean over all 3 tokens
    assert torch.allclose(grad, torch.tensor([[-2 / 3, 0.0], [0.5 / 3, 0.0]]), atol=1e-6)
    assert out.metrics["masked_frac"].item() == pytest.approx(1 / 3)
    assert out.metrics["clip_frac"].item() == 0.0
    assert clip_range(LossConfig(name="decoupled_ppo")) == (0.2, 0.2)
    # a cap above 6 keeps the third token
    out = compute_loss(inputs, LossConfig(name="decoupled_ppo", kl_coef=0, behaviour_weight_cap=7.0))
    assert out.loss.item() == pytest.approx(-(2 + 6 - 0.5) / 3, abs=1e-6)


def test_decoupled_ppo_with_a_proximal_policy_clips_around_it_not_around_the_sampler():
    # AReaL's decoupled objective with a distinct pi_prox, per token (u = pi/pi_prox, w = pi_prox/mu):
    #  A = +1: u = 1.5 (clipped to 1.2), w = 2   -> 2 * 1.2 = 2.4, no gradient
    #  A = -1: u = 0.5 (min(-0.5, -0.8) = -0.8), w = 1  -> -0.8, no gradient
    #  A = -1: u = 1.1 (inside), w = 0.5  -> -0.55, gradient -(-0.5 * 1.1) / 3
    prox = [[math.log(2)], [0.0], [math.log(0.5)]]  # log pi_prox - log mu
    log_ratios = [[math.log(2 * 1.5)], [math.log(0.5)], [math.log(0.5 * 1.1)]]  # log pi - log mu = log(w u)
    learner, inputs, _ = batch(log_ratios, [1.0, -1.0, -1.0], proximal=prox)
    out, grad = loss_and_grad(inputs, learner, name="decoupled_ppo")
    assert out.loss.item() == pytest.approx(-(2.4 - 0.8 - 0.55) / 3, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[0.0], [0.0], [0.55 / 3]]), atol=1e-6)
    assert out.metrics["clip_frac"].item() == pytest.approx(2 / 3)
    # the behaviour weight is pi_prox/mu, not pi/mu: mean of 2, 1, 0.5
    assert out.metrics["is_weight_mean"].item() == pytest.approx(3.5 / 3, abs=1e-6)


def test_token_tis_truncates_weights_and_seq_mis_masks_whole_sequences():
    #  A = +1: log r = (log 3, log 0.5): weights min(3, 2) = 2 and 0.5; sequence ratio 1.5, kept
    #  A = -1: (log 1.5, log 1.5): sequence ratio 2.25 > 2, masked
    #  A = -1: (log 0.8, log 0.9): sequence ratio 0.72, kept
    learner, inputs, _ = batch([[math.log(3), math.log(0.5)], [math.log(1.5), math.log(1.5)],
                                [math.log(0.8), math.log(0.9)]], [1.0, -1.0, -1.0])
    out, grad = loss_and_grad(inputs, learner, name="tis_mis")
    # (the second sequence's per-token geometric mean, 1.5, would have passed: the mask judges the
    # whole sequence's ratio)
    assert out.loss.item() == pytest.approx(-((2 + 0.5) - (0.8 + 0.9)) / 6, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[-2.0, -0.5], [0.0, 0.0], [0.8, 0.9]]) / 6, atol=1e-6)
    assert out.metrics["clip_frac"].item() == pytest.approx(1 / 6)  # one truncated token
    assert out.metrics["masked_frac"].item() == pytest.approx(1 / 3)  # one masked sequence
    # the lower bound masks too: with mis_low 0.75 the third sequence (0.72) goes as well
    out = compute_loss(inputs, LossConfig(name="tis_mis", kl_coef=0, mis_low=0.75))
    assert out.loss.item() == pytest.approx(-2.5 / 6, abs=1e-6)
    with pytest.raises(ValueError, match="mis_low 2.0 must be below mis_high 2.0"):
        LossConfig(name="tis_mis", mis_low=2.0)


def test_opsm_masks_only_negative_advantage_sequences_the_learner_has_moved_away_from():
    #  A = -1: log r = (-0.3, -0.1): mean log(mu/pi) = 0.2 > delta -> masked
    #  A = -1: (0.05, -0.03): mean log(mu/pi) = -0.01 -> kept; ratios inside the clip range: -mean(r)
    #  A = +1: (-0.5, -0.5): drifted, but A > 0 -> kept; min(r, clip(r) = 0.8) = r
    learner, inputs, _ = batch([[-0.3, -0.1], [0.05, -0.03], [-0.5, -0.5]], [-1.0, -1.0, 1.0])
    out, grad = loss_and_grad(inputs, learner, name="opsm")
    second = -(E(0.05) + E(-0.03)) / 2
    assert out.loss.item() == pytest.approx(-(0 + second + E(-0.5)) / 3, abs=1e-6)
    # GRPO's normaliser: a token's gradient is -A r / (|o_i| * number of sequences)
    expected = torch.tensor([[0.0, 0.0], [E(0.05), E(-0.03)], [-E(-0.5), -E(-0.5)]]) / 6
    assert torch.allclose(grad, expected, atol=1e-6)
    assert out.metrics["masked_frac"].item() == pytest.approx(1 / 3)
    # delta 0.3 keeps the first sequence; its first token is clipped (min(-0.741, -0.8) = -0.8)
    out = compute_loss(inputs, LossConfig(name="opsm", kl_coef=0, opsm_delta=0.3))
    first = -(0.8 + E(-0.1)) / 2
    assert out.loss.item() == pytest.approx(-(first + second + E(-0.5)) / 3, abs=1e-6)
    assert out.metrics["masked_frac"].item() == 0.0
    assert out.metrics["clip_frac"].item() == pytest.approx(1 / 6)


def test_proximal_logprobs_of_the_wrong_shape_are_named():
    learner, inputs, _ = batch([[0.1]], [1.0])
    bad = LossInputs(learner, inputs.sampler_logprobs, inputs.mask, inputs.advantages, inputs.group_ids,
                     proximal_logprobs=torch.zeros(1, 2))
    with pytest.raises(ValueError, match="proximal_logprobs has shape"):
        compute_loss(bad, LossConfig(name="decoupled_ppo"))
