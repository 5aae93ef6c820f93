"""Losses whose importance weight is per sequence: GSPO (PPO-clipped sequence ratio), GMPO
(geometric mean of token ratios, clipped in log space) and TOPR (tapered off-policy REINFORCE)."""

from __future__ import annotations

import torch
from torch import Tensor

from swarm.losses.base import (
    LossInputs,
    clamped_exp,
    masked_sum,
    mean_over_sequences,
    normalise_seq_mean,
    per_sequence_mean,
    ppo_clip_objective,
    sequence_logprob,
    valid_sequences,
    weighted_mean_var,
)
from swarm.losses.diagnostics import sign_split_metrics, token_escape_metrics
from swarm.losses.registry import LossConfig, clip_range, register_loss


def clipped_sequence_loss(log_weight: Tensor, inputs: LossInputs, config: LossConfig,
                          token_keep: Tensor | None = None) -> tuple[Tensor, dict]:
    """PPO clip on a per-sequence weight exp(log_weight) (B,); mean over sequences. Shared by GSPO
    and GEPO, which differ only in the denominator inside `log_weight`. `token_keep` (B, T): the
    tokens that carry the sequence's gradient when `log_weight`'s gradient was masked to them
    (GEPO's gepo_clip="weight+token"), for the metrics only."""
    eps_low, eps_high = clip_range(config)
    weight = clamped_exp(log_weight)
    objective, clipped = ppo_clip_objective(weight, inputs.advantages, eps_low, eps_high)
    loss = -mean_over_sequences(objective, inputs.mask)
    valid = valid_sequences(inputs.mask)
    mean, var = weighted_mean_var(weight, valid)
    clip_frac = (clipped * valid).sum() / valid.sum().clamp(min=1)
    # each sequence's coefficient on its log-prob's gradient, in token units: the sequence log-prob is a
    # mean over its tokens or their sum, and a sum gives each of its tokens the whole coefficient
    coefficient = weight.detach() * inputs.advantages * (1 - clipped)
    if config.seq_logprob_mode == "sum":
        coefficient = coefficient * inputs.mask.sum(-1)
    metrics = {"is_weight_mean": mean, "is_weight_var": var, "clip_frac": clip_frac,
               **sign_split_metrics(clipped, coefficient, inputs.advantages, valid),
               **token_escape_metrics(inputs, clipped, eps_low, eps_high)}
    if token_keep is not None:  # the coefficients of the tokens that keep a gradient
        per_token = coefficient[:, None] * token_keep / inputs.mask.sum(-1, keepdim=True).clamp(min=1)
        split = sign_split_metrics(clipped[:, None].expand_as(token_keep), per_token, inputs.advantages, inputs.mask)
        metrics.update(coef_pos_share=split["coef_pos_share"], coef_net=split["coef_net"])
    return loss, metrics


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


# GMPO (Zhao et al., 2025): maximise sign(A) * prod_t min(r_t A, clip(r_t, e^-eps_low, e^eps_high) A)^(1/|y|).
# In log space, with the token log-ratio d_t = l - s and c_t = clip(d_t, -eps_low, eps_high), the
# pessimistic min is min(d_t, c_t) for A > 0 and max(d_t, c_t) for A < 0 (a larger ratio is worse when
# A < 0). The bounds apply to d_t itself whatever the sign of A: clamping the sign-adjusted -d_t
# would swap eps_low and eps_high for negative advantages. eps = 0.4 (the paper's range e^-0.4..e^0.4).
# The clip acts on log-ratios, not ratios: that is the reference implementation's mistake we do not copy.
@register_loss(
    "gmpo", eps_low=0.4, eps_high=0.4, advantage_mode="std", level="sequence",
    summary="geometric mean of token ratios, token log-ratios clipped in log space (Zhao et al.)",
)
def gmpo_loss(inputs: LossInputs, config: LossConfig) -> tuple[Tensor, dict]:
    eps_low, eps_high = clip_range(config)
    mask = inputs.mask
    adv = inputs.advantages
    log_ratio = inputs.learner_logprobs - inputs.sampler_logprobs  # (B, T)
    bounded = log_ratio.clamp(-eps_low, eps_high)
    positive = (adv >= 0)[:, None]  # (B, 1); A = 0 contributes nothing either way
    clipped_log_ratio = torch.where(positive, torch.minimum(log_ratio, bounded), torch.maximum(log_ratio, bounded))
    geo_weight = clamped_exp(per_sequence_mean(clipped_log_ratio, mask))  # (B,)
    loss = -mean_over_sequences(adv * geo_weight, mask)
    valid = valid_sequences(mask)
    raw_weight = clamped_exp(per_sequence_mean(log_ratio, mask)).detach()
    mean, var = weighted_mean_var(raw_weight, valid)
    clipped = ((clipped_log_ratio != log_ratio) & (adv != 0)[:, None]).to(mask.dtype)
    clip_frac = (clipped * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"is_weight_mean": mean, "is_weight_var": var, "clip_frac": clip_frac}


# TOPR (Le Roux et al., 2025, arXiv:2503.14286): maximise
#     sum_{A_i >= 0} A_i log pi(y_i)  +  sum_{A_i < 0} sg(min(1, pi(y_i) / mu(y_i))) A_i log pi(y_i)
# over the batch (averaged over sequences), where log pi(y) = sum_t log pi(y_t | ...) and the ratio is
# the whole sequence's, exp(sum_t (l - s)): no importance weight for positive advantages, a truncated
# one for negative ones. The paper has no clip range to set. That form is the default
# (`topr_form="paper"`); `topr_form="normalised"` keeps the registry's earlier variant, whose ratio
# follows `seq_logprob_mode` ("mean": a per-token geometric mean, which truncates far less) and whose
# per-token terms are averaged like GRPO's (mean over a sequence's tokens, then over sequences).
@register_loss(
    "topr", eps_low=0.0, eps_high=0.0, advantage_mode="std", level="sequence",
    summary="tapered off-policy REINFORCE: weight 1 for A >= 0, sg(min(1, p(y)/q(y))) for A < 0 (Le Roux et al.)",
)
def topr_loss(inputs: LossInputs, config: LossConfig) -> tuple[Tensor, dict]:
    mask = inputs.mask
    adv = inputs.advantages
    paper = config.topr_form == "paper"
    mode = "sum" if paper else config.seq_logprob_mode
    log_ratio = sequence_logprob(inputs.learner_logprobs, mask, mode) - sequence_logprob(
        inputs.sampler_logprobs, mask, mode
    )
    ratio = clamped_exp(log_ratio).detach()  # (B,)
    negative = adv < 0
    weight = torch.where(negative, ratio.clamp(max=1.0), torch.ones_like(ratio))
    if paper:
        loss = -mean_over_sequences(weight * adv * masked_sum(inputs.learner_logprobs, mask, -1), mask)
    else:
        loss = -normalise_seq_mean((weight * adv)[:, None] * inputs.learner_logprobs, mask)
    valid = valid_sequences(mask)
    mean, var = weighted_mean_var(ratio, valid)
    truncated = (negative & (ratio > 1.0)).to(mask.dtype)
    clip_frac = (truncated * valid).sum() / valid.sum().clamp(min=1)
    return loss, {"is_weight_mean": mean, "is_weight_var": var, "clip_frac": clip_frac}
