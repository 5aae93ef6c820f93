"""GEPO: Group Expectation Policy Optimization (Zhang et al., 2025, arXiv:2508.17850).

The importance weight of completion i of prompt x replaces the sampler probability q(y_i|x) by its
expectation over the group of G completions of that prompt:

    w_i = p(y_i|x) / E_q[q],   E_q[q] ~= sum_j q_j^2 / sum_j q_j,   q_j = exp(S_j)

In log space, log E_q[q] = logsumexp_j(2 S_j) - logsumexp_j(S_j), which never under- or overflows
however small the sequence probabilities are. The denominator carries no gradient. Theorem 1 of
the paper: Var(p/q) - Var(p/E_q[q]) >= exp(KL(p||q)) - C, i.e. exponentially lower variance as the
sampler falls behind the learner.

Departure from the reference implementation (HanlardResearch/Hetero-RL): there the "group" is a
shuffled micro-batch that mixes prompts; the paper's expectation is per prompt, so that is our
default. `gepo_expectation="batch"` reproduces the reference's behaviour for comparison.

Departure from the paper, by default (`gepo_clip="weight+token-neg"`): the paper clips one number
per sequence, so inside a sequence whose weight is in range a negative-advantage token whose own
ratio p_t/q_t is already below 1 - eps keeps being pushed down. That is why the paper's GEPO drifted
2-3x further from its samplers than GRPO at staleness 8 and ended below it; dropping exactly those
tokens' gradient, as PPO's token clip would, fixed it (38.7 against 33.9 at staleness 8 on 6 seeds)
without losing anything at 64 (docs/staleness.md, "GEPO's weak spot"). On-policy every token ratio is 1 and
nothing changes. `gepo_clip="weight"` is the paper.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from swarm.losses.base import (
    LossInputs,
    clamped_exp,
    group_index,
    group_logsumexp,
    mean_over_sequences,
    ppo_clip_objective,
    sequence_logprob,
    valid_sequences,
    weighted_mean_var,
)
from swarm.losses.diagnostics import gepo_weight_metrics, sign_split_metrics
from swarm.losses.registry import LossConfig, clip_range, register_loss
from swarm.losses.sequence_level import clipped_sequence_loss


@torch.no_grad()
def log_group_expectation(sampler_seq_logprob: Tensor, group_ids: Tensor, valid: Tensor) -> Tensor:
    """(B,) -> (B,): log E_q[q] of each sequence's group, broadcast back to its members."""
    index, num_groups = group_index(group_ids)
    s = sampler_seq_logprob
    log_e = group_logsumexp(2 * s, index, num_groups, valid) - group_logsumexp(s, index, num_groups, valid)
    return log_e[index]


@register_loss(
    "gepo", eps_low=0.2, eps_high=0.2, advantage_mode="std", level="group",
    summary="group-expectation weight p(y|x) / E_q[q] per prompt group, PPO clip (Zhang et al., GEPO)",
)
def gepo_loss(inputs: LossInputs, config: LossConfig) -> tuple[Tensor, dict]:
    mode = config.seq_logprob_mode
    mask = inputs.mask
    learner_seq = sequence_logprob(inputs.learner_logprobs, mask, mode)
    sampler_seq = sequence_logprob(inputs.sampler_logprobs, mask, mode)
    groups = inputs.group_ids if config.gepo_expectation == "group" else torch.zeros_like(inputs.group_ids)
    valid = valid_sequences(mask)
    log_expectation = log_group_expectation(sampler_seq, groups, valid)
    log_weight = learner_seq - log_expectation
    eps_low, eps_high = clip_range(config)
    if config.gepo_clip == "ratio":
        loss, metrics, clipped = _ratio_clipped_loss(learner_seq, sampler_seq, log_expectation, inputs, config)
    else:
        keep = None
        if config.gepo_clip in ("weight+token", "weight+token-neg"):
            # the weight's value stays p / E_q[q]; its gradient flows only through the tokens inside
            # the token-level trust region (w A grad of the masked sequence log-prob)
            keep = _token_trust_region(inputs, eps_low, eps_high, negative_only=config.gepo_clip == "weight+token-neg")
            masked = sequence_logprob(inputs.learner_logprobs * keep, mask, mode)
            log_weight = log_weight.detach() + masked - masked.detach()
        loss, metrics = clipped_sequence_loss(log_weight, inputs, config, token_keep=keep)
        clipped = ppo_clip_objective(clamped_exp(log_weight.detach()), inputs.advantages, eps_low, eps_high)[1]
    metrics.update(gepo_weight_metrics(learner_seq, sampler_seq, log_expectation, clipped, inputs.advantages, valid,
                                       eps_low, eps_high))
    return loss, metrics


def _token_trust_region(inputs: LossInputs, eps_low: float, eps_high: float, negative_only: bool = False) -> Tensor:
    """(B, T) float: 0 for the tokens PPO's token-level clip drops (A > 0 and p_t / q_t > 1 + eps_high,
    or A < 0 and p_t / q_t < 1 - eps_low; only the latter with `negative_only`), 1 elsewhere."""
    log_r = (inputs.learner_logprobs - inputs.sampler_logprobs).detach()
    adv = inputs.advantages[:, None]
    up = (adv > 0) & (log_r > math.log1p(eps_high)) if not negative_only else torch.zeros_like(log_r, dtype=torch.bool)
    down = (adv < 0) & (log_r < (math.log(1 - eps_low) if eps_low < 1 else -math.inf))
    return (~(up | down)).to(log_r.dtype)


def _ratio_clipped_loss(learner_seq: Tensor, sampler_seq: Tensor, log_expectation: Tensor, inputs: LossInputs,
                        config: LossConfig) -> tuple[Tensor, dict, Tensor]:
    """`gepo_clip="ratio"`: the objective w0 * min(rho A, clip(rho) A), with rho = p / q the sequence's
    own ratio and w0 = q / E_q[q] (no gradient). Unclipped, its gradient is w A grad log p, GEPO's
    (w = rho * w0); the clip is PPO's trust region on how far the learner moved from the sampler on
    this sequence, where GEPO's own clip is centred on E_q[q] and so clips on-policy sequences whose
    q is far from the group's (benchmarks/results/gepo_weak_spot.md)."""
    eps_low, eps_high = clip_range(config)
    log_rho = learner_seq - sampler_seq
    w0 = clamped_exp(sampler_seq - log_expectation).detach()
    rho = clamped_exp(log_rho)
    objective, clipped = ppo_clip_objective(rho, inputs.advantages, eps_low, eps_high)
    loss = -mean_over_sequences(w0 * objective, inputs.mask)
    valid = valid_sequences(inputs.mask)
    weight = (w0 * rho).detach()
    mean, var = weighted_mean_var(weight, valid)
    clip_frac = (clipped * valid).sum() / valid.sum().clamp(min=1)
    coefficient = weight * inputs.advantages * (1 - clipped)
    if config.seq_logprob_mode == "sum":  # in token units, as clipped_sequence_loss counts them
        coefficient = coefficient * inputs.mask.sum(-1)
    metrics = {"is_weight_mean": mean, "is_weight_var": var, "clip_frac": clip_frac,
               **sign_split_metrics(clipped, coefficient, inputs.advantages, valid)}
    return loss, metrics, clipped
