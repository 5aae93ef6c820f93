"""Losses whose importance weight is per sequence: GSPO (PPO-clipped sequence ratio), GMPO
(geometric mean of token ratios, clipped in log space) and TOPR (tapered off-policy REINFORCE)."""

from __future__ import annotations

import torch
from torch import Tensor

from swarm.losses.base import (
    LossInputs,
    clamped_exp,
    mean_over_sequences,
    normalise_seq_mean,
    per_sequence_mean,
    ppo_clip_objective,
    sequence_logprob,
    valid_sequences,
    weighted_mean_var,
)
from swarm.losses.registry import LossConfig, clip_range, register_loss


def clipped_sequence_loss(log_weight: Tensor, inputs: LossInputs, config: LossConfig) -> tuple[Tensor, dict]:
    """PPO clip on a per-sequence weight exp(log_weight) (B,); mean over sequences. Shared by GSPO
    and GEPO, which differ only in the denominator inside `log_weight`."""
    eps_low, eps_high = clip_range(config)
    weight = clamped_exp(log_weight)
    objective, clipped = ppo_clip_objective(weight, inputs.advantages, eps_low, eps_high)
    loss = -mean_over_sequences(objective, inputs.mask)
    valid = valid_sequences(inputs.mask)
    mean, var = weighted_mean_var(weight, valid)
    clip_frac = (clipped * valid).sum() / valid.sum().clamp(min=1)
    return loss, {"is_weight_mean": mean, "is_weight_var": var, "clip_frac": clip_frac}


# GSPO (Zheng et al., 2025): s_i = (pi(y_i|x) / q(y_i|x))^(1/|y_i|), clip range 3e-4 / 4e-4 from
# the GSPO paper; a GRPO-sized range would leave the sequence ratio effectively unclipped.
@register_loss(
    "gspo", eps_low=3e-4, eps_high=4e-4, advantage_mode="std", level="sequence",
    summary="length-normalised sequence ratio, PPO clip with GSPO's tight range (Zheng et al.)",
)
def gspo_loss(inputs: LossInputs, config: LossConfig) -> tuple[Tensor, dict]:
    mode = config.seq_logprob_mode
    log_weight = sequence_logprob(inputs.learner_logprobs, inputs.mask, mode) - sequence_logprob(
        inputs.sampler_logprobs, inputs.mask, mode
    )
    return clipped_sequence_loss(log_weight, inputs, config)


# GMPO (Zhao et al., 2025): maximise sign(A) * prod_t min(r_t A, clip(r_t) A)^(1/|y|); in log space
# the pessimistic min becomes sgn(A) * min(sgn(A) * d_t, clip(sgn(A) * d_t, -eps_low, eps_high)) on
# the token log-ratio d_t = l - s, with eps = 0.4 (the paper's range e^-0.4..e^0.4). The clip acts
# on log-ratios, not ratios: that is the reference implementation's mistake we do not copy.
@register_loss(
    "gmpo", eps_low=0.4, eps_high=0.4, advantage_mode="std", level="sequence",
    summary="geometric mean of token ratios, token log-ratios clipped in log space (Zhao et al.)",
)
def gmpo_loss(inputs: LossInputs, config: LossConfig) -> tuple[Tensor, dict]:
    eps_low, eps_high = clip_range(config)
    mask = inputs.mask
    adv = inputs.advantages
    sign = torch.sign(adv)[:, None]  # (B, 1)
    log_ratio = inputs.learner_logprobs - inputs.sampler_logprobs  # (B, T)
    signed = sign * log_ratio
    pessimistic = torch.minimum(signed, signed.clamp(-eps_low, eps_high))
    clipped_log_ratio = sign * pessimistic
    geo_weight = clamped_exp(per_sequence_mean(clipped_log_ratio, mask))  # (B,)
    loss = -mean_over_sequences(adv * geo_weight, mask)
    valid = valid_sequences(mask)
    raw_weight = clamped_exp(per_sequence_mean(log_ratio, mask)).detach()
    mean, var = weighted_mean_var(raw_weight, valid)
    clipped = ((pessimistic != signed) & (sign != 0)).to(mask.dtype)
    clip_frac = (clipped * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"is_weight_mean": mean, "is_weight_var": var, "clip_frac": clip_frac}


# TOPR (Le Roux et al., 2025): positive-advantage sequences get the plain REINFORCE gradient
# A * grad log pi (no importance weight); negative ones are weighted by the truncated ratio
# sg(min(1, pi / q)). The per-token REINFORCE terms are averaged like GRPO's (mean over a
# sequence's tokens, then over sequences) so that losses are comparable across the registry.
@register_loss(
    "topr", eps_low=0.0, eps_high=0.0, advantage_mode="std", level="sequence",
    summary="tapered off-policy REINFORCE: weight 1 for A >= 0, sg(min(1, p/q)) for A < 0 (Le Roux et al.)",
)
def topr_loss(inputs: LossInputs, config: LossConfig) -> tuple[Tensor, dict]:
    mask = inputs.mask
    adv = inputs.advantages
    mode = config.seq_logprob_mode
    log_ratio = sequence_logprob(inputs.learner_logprobs, mask, mode) - sequence_logprob(
        inputs.sampler_logprobs, mask, mode
    )
    ratio = clamped_exp(log_ratio).detach()  # (B,)
    negative = adv < 0
    weight = torch.where(negative, ratio.clamp(max=1.0), torch.ones_like(ratio))
    objective = (weight * adv)[:, None] * inputs.learner_logprobs  # (B, T)
    loss = -normalise_seq_mean(objective, mask)
    valid = valid_sequences(mask)
    mean, var = weighted_mean_var(ratio, valid)
    truncated = (negative & (ratio > 1.0)).to(mask.dtype)
    clip_frac = (truncated * valid).sum() / valid.sum().clamp(min=1)
    return loss, {"is_weight_mean": mean, "is_weight_var": var, "clip_frac": clip_frac}
