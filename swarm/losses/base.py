"""Shared types and tensor helpers of the policy-loss family.

Shapes: B sequences (completions), T completion tokens (right-padded), so every per-token tensor
is (B, T) and every per-sequence tensor is (B,). Losses compute in float32 whatever the input
dtype (bf16 log-probs are upcast; gradients flow back to the original tensor).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

SeqLogprobMode = Literal["mean", "sum"]

# exp() of a log-ratio beyond this is clamped before it enters an objective: a ratio of e^20
# (5e8) already means the sample is useless, and without the clamp a 4096-token sequence in
# "sum" mode overflows fp32 (e^88) and poisons the whole batch with inf/NaN. verl applies the
# same +-20 guard to its log-ratios.
MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class LossInputs:
    """Everything a policy loss sees. Advantages are computed beforehand (advantages.py)."""

    learner_logprobs: Tensor  # (B, T) log pi_theta(y_t | x, y_<t); carries the gradient
    sampler_logprobs: Tensor  # (B, T) log q(y_t | ...) recorded by the sampler; no gradient
    mask: Tensor  # (B, T) 1 for completion tokens, 0 for padding (bool or float)
    advantages: Tensor  # (B,) one advantage per completion
    group_ids: Tensor  # (B,) integer id; completions answering the same prompt share one
    # (B, T) log pi_prox, the proximal policy of decoupled PPO (swarm/losses/off_policy.py); no
    # gradient. None, as the learner passes it: the learner's own log-probs before this step.
    proximal_logprobs: Tensor | None = None

    def validate(self) -> None:
        """Raise ValueError naming the offending input when shapes disagree."""
        b, t = self.learner_logprobs.shape
        for name in ("sampler_logprobs", "mask", "proximal_logprobs"):
            if name == "proximal_logprobs" and self.proximal_logprobs is None:
                continue
            if tuple(getattr(self, name).shape) != (b, t):
                raise ValueError(
                    f"{name} has shape {tuple(getattr(self, name).shape)}, expected {(b, t)} "
                    "like learner_logprobs"
                )
        for name in ("advantages", "group_ids"):
            if tuple(getattr(self, name).shape) != (b,):
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected ({b},)")


@dataclass
class LossOutputs:
    loss: Tensor  # scalar, to minimise
    metrics: dict[str, Tensor] = field(default_factory=dict)  # detached scalars

    def metrics_as_floats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.metrics.items()}


# ----------------------------------------------------------------------------------------------
# Reductions


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def per_sequence_mean(x: Tensor, mask: Tensor) -> Tensor:
    """(B, T) -> (B,): mean over each sequence's own tokens (0 for an empty sequence)."""
    return masked_sum(x, mask, -1) / mask.sum(-1).clamp(min=1)


def sequence_logprob(token_logprobs: Tensor, mask: Tensor, mode: SeqLogprobMode) -> Tensor:
    """(B, T) -> (B,): log-prob of each sequence, length-normalised ("mean", the GEPO reference
    implementation's choice) or the plain sum over tokens ("sum")."""
    if mode == "mean":
        return per_sequence_mean(token_logprobs, mask)
    if mode == "sum":
        return masked_sum(token_logprobs, mask, -1)
    raise ValueError(f"unknown sequence log-prob mode {mode!r}; use 'mean' or 'sum'")


@dataclass(frozen=True)
class BatchTotals:
    """Counts over a whole optimizer batch, for a loss computed one micro-batch at a time: inside
    `batch_totals(...)` the loss reductions divide by these instead of the micro-batch's own, so
    the micro-batch losses add up to exactly the loss of the whole batch (a mean over each
    micro-batch, weighted by its share of sequences, would not be: token means weight by tokens,
    Dr.GRPO's constant by the padded width)."""

    sequences: int  # sequences with at least one completion token
    tokens: int  # completion tokens
    rows: int  # sequences, empty ones included
    width: int  # the longest completion


_TOTALS: ContextVar[BatchTotals | None] = ContextVar("batch_totals", default=None)


@contextmanager
def batch_totals(totals: BatchTotals):
    token = _TOTALS.set(totals)
    try:
        yield
    finally:
        _TOTALS.reset(token)


def valid_sequences(mask: Tensor) -> Tensor:
    """(B,) float: 1 for sequences with at least one completion token."""
    return (mask.sum(-1) > 0).to(mask.dtype)


def mean_over_sequences(x: Tensor, mask: Tensor) -> Tensor:
    """(B,) -> scalar: mean over the sequences that have tokens (of the whole batch, inside
    `batch_totals`)."""
    valid = valid_sequences(mask)
    totals = _TOTALS.get()
    return (x * valid).sum() / (valid.sum().clamp(min=1) if totals is None else max(totals.sequences, 1))


# Token-level normalisers: how per-token objectives become one scalar. Kept apart from the
# objectives themselves because this choice is exactly where GRPO, Dr.GRPO and BNPO differ.


def normalise_seq_mean(per_token: Tensor, mask: Tensor, max_len: int | None = None) -> Tensor:
    """Mean over each sequence's tokens, then over sequences (GRPO, DeepSeekMath)."""
    return mean_over_sequences(per_sequence_mean(per_token, mask), mask)


def normalise_token_mean(per_token: Tensor, mask: Tensor, max_len: int | None = None) -> Tensor:
    """Sum over all tokens of the batch / number of tokens (BNPO, CISPO, DAPO)."""
    totals = _TOTALS.get()
    return masked_sum(per_token, mask) / (mask.sum().clamp(min=1) if totals is None else max(totals.tokens, 1))


def local_token_mean(per_token: Tensor, mask: Tensor) -> Tensor:
    """Token mean over these tokens only, whatever `batch_totals` says (for diagnostics)."""
    return masked_sum(per_token, mask) / mask.sum().clamp(min=1)


def normalise_fixed_length(per_token: Tensor, mask: Tensor, max_len: int | None = None) -> Tensor:
    """Sum over all tokens / (B * max_len): Dr.GRPO's length-unbiased constant normaliser."""
    b, t = mask.shape
    totals = _TOTALS.get()
    if totals is not None:
        b, t = totals.rows, totals.width
    return masked_sum(per_token, mask) / (b * (max_len or t))


# ----------------------------------------------------------------------------------------------
# Importance weights and clipping


def clamped_exp(log_ratio: Tensor) -> Tensor:
    return torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def ppo_clip_objective(ratio: Tensor, advantage: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic objective min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A), to maximise.

    Returns the objective and a float mask of the elements where the clipped branch was taken
    (the "clip fraction" counts these)."""
    unclipped = ratio * advantage
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantage
    objective = torch.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped).to(ratio.dtype)
    return objective, was_clipped


def weighted_mean_var(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and (population) variance of x over the elements where weight is 1, in float64 so
    that weights as large as e^20 do not overflow when squared."""
    x = x.detach().double()
    weight = weight.detach().double()
    n = weight.sum().clamp(min=1)
    mean = (x * weight).sum() / n
    var = (((x - mean) ** 2) * weight).sum() / n
    return mean.float(), var.float()


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary integer group ids to 0..G-1. Returns (index (B,), G)."""
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(uniq.numel())


def group_logsumexp(x: Tensor, index: Tensor, num_groups: int, valid: Tensor) -> Tensor:
    """(B,) -> (G,): logsumexp of x over the valid members of each group, stable."""
    neg_inf = torch.finfo(x.dtype).min
    x = torch.where(valid > 0, x, torch.full_like(x, neg_inf))
    group_max = torch.full((num_groups,), neg_inf, dtype=x.dtype, device=x.device)
    group_max = group_max.scatter_reduce(0, index, x, reduce="amax", include_self=True)
    shifted = torch.exp(x - group_max[index]) * valid
    sums = torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add(0, index, shifted)
    return torch.log(sums.clamp(min=torch.finfo(x.dtype).tiny)) + group_max
