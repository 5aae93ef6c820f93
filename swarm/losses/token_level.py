"""Losses whose importance weight is per token: GRPO, Dr.GRPO, BNPO (PPO-clipped ratio
exp(l - s)) and CISPO (stop-gradient clipped weight on the REINFORCE term)."""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from swarm.losses.base import (
    LossInputs,
    clamped_exp,
    normalise_fixed_length,
    normalise_seq_mean,
    normalise_token_mean,
    ppo_clip_objective,
    weighted_mean_var,
)
from swarm.losses.diagnostics import sign_split_metrics
from swarm.losses.registry import LossConfig, clip_range, register_loss

Normaliser = Callable[[Tensor, Tensor, "int | None"], Tensor]


def _clipped_token_loss(inputs: LossInputs, config: LossConfig, normalise: Normaliser) -> tuple[Tensor, dict]:
    """PPO-clipped token ratio; the three token-level GRPO variants differ only in `normalise`
    (and in the advantage normalisation their specs name)."""
    eps_low, eps_high = clip_range(config)
    mask = inputs.mask
    ratio = clamped_exp(inputs.learner_logprobs - inputs.sampler_logprobs)  # (B, T)
    objective, clipped = ppo_clip_objective(ratio, inputs.advantages[:, None], eps_low, eps_high)
    loss = -normalise(objective, mask, config.max_completion_length)
    mean, var = weighted_mean_var(ratio, mask)
    clip_frac = (clipped * mask).sum() / mask.sum().clamp(min=1)
    # each token's coefficient on its log-prob gradient, with its sequence's 1 / length (GRPO's
    # mean over a sequence's tokens) so that a sequence's coefficients add up like a sequence weight's
    coefficient = ratio.detach() * inputs.advantages[:, None] * (1 - clipped) / mask.sum(-1, keepdim=True).clamp(min=1)
    return loss, {"is_weight_mean": mean, "is_weight_var": var, "clip_frac": clip_frac,
                  **sign_split_metrics(clipped, coefficient, inputs.advantages, mask)}


@register_loss(
    "grpo", eps_low=0.2, eps_high=0.2, advantage_mode="std", level="token",
    summary="token ratio, PPO clip, mean over tokens then sequences (DeepSeekMath)",
)
def grpo_loss(inputs: LossInputs, config: LossConfig) -> tuple[Tensor, dict]:
    return _clipped_token_loss(inputs, config, normalise_seq_mean)


@register_loss(
    "dr_grpo", eps_low=0.2, eps_high=0.2, advantage_mode="no_std", level="token",
    summary="GRPO without std division; sum over tokens / (B * max_len) (Liu et al., Dr.GRPO)",
)
def dr_grpo_loss(inputs: LossInputs, config: LossConfig) -> tuple[Tensor, dict]:
    return _clipped_token_loss(inputs, config, normalise_fixed_length)


@register_loss(
    "bnpo", eps_low=0.2, eps_high=0.2, advantage_mode="beta", level="token",
    summary="Beta-normalised advantages, token ratio, batch token-mean (Xiao et al., BNPO)",
)
def bnpo_loss(inputs: LossInputs, config: LossConfig) -> tuple[Tensor, dict]:
    return _clipped_token_loss(inputs, config, normalise_token_mean)


# CISPO (MiniMax-M1, arXiv:2506.13585, eq. 4): J = 1/sum|o_i| * sum_i sum_t sg(clip(r_it, 1 - eps_low,
# 1 + eps_high)) * A_i * log pi(y_it). MiniMax-M1 sets no effective lower bound (eps_low large: here 1,
# a clip at 0) and tunes only the upper one without publishing its value. ScaleRL (Khatri et al.,
# arXiv:2510.13786), which adopts CISPO, writes the weight as sg(min(r_it, eps_max)) with eps_max = 4:
# an absolute cap, so eps_high = 3 here (1 + 3 = 4). The registry's earlier cap, 1 + 0.28 (DAPO's
# clip-higher value, borrowed), remains one option away: --eps-high 0.28.
@register_loss(
    "cispo", eps_low=1.0, eps_high=3.0, advantage_mode="std", level="token",
    summary="stop-gradient clipped token weight times A * log pi; no token's gradient is dropped (MiniMax-M1)",
)
def cispo_loss(inputs: LossInputs, config: LossConfig) -> tuple[Tensor, dict]:
    eps_low, eps_high = clip_range(config)
    mask = inputs.mask
    ratio = clamped_exp(inputs.learner_logprobs - inputs.sampler_logprobs).detach()
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    objective = weight * inputs.advantages[:, None] * inputs.learner_logprobs
    loss = -normalise_token_mean(objective, mask)
    mean, var = weighted_mean_var(ratio, mask)
    clipped = (weight != ratio).to(mask.dtype)
    clip_frac = (clipped * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"is_weight_mean": mean, "is_weight_var": var, "clip_frac": clip_frac}
