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
"""

from __future__ import annotations

import torch
from torch import Tensor

from swarm.losses.base import LossInputs, group_index, group_logsumexp, sequence_logprob, valid_sequences
from swarm.losses.registry import LossConfig, register_loss
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
    log_weight = learner_seq - log_group_expectation(sampler_seq, groups, valid_sequences(mask))
    return clipped_sequence_loss(log_weight, inputs, config)
