"""Group-normalised advantages, one per completion.

A group is the G completions a sampler drew for one prompt. Rules shared by every mode:
- a completion whose reward is missing (NaN: unscorable) is kept out of its group's baseline and
  gets advantage 0, as TRL does;
- a group whose (present) rewards are all equal carries no learning signal: advantage 0;
- a group with fewer than two present rewards has no baseline: advantage 0.

Modes: "std" (GRPO: (r - mean) / std), "no_std" (Dr.GRPO: r - mean), "beta" (BNPO: (r - p) / f(p)
with f the Beta(alpha, beta) density fitted to the batch's per-prompt accuracies).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

AdvantageMode = Literal["std", "no_std", "beta"]

# BNPO clamps 1/f(p) so that a prompt whose accuracy sits where the fitted density vanishes cannot
# produce an unbounded advantage (the BNPO authors' code uses the same bound).
BNPO_MAX_WEIGHT = 1e6


def _group_stats(rewards: Tensor, index: Tensor, num_groups: int, present: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group count, mean and unbiased std over present rewards, each (G,)."""
    r = torch.where(present, rewards, torch.zeros_like(rewards))
    p = present.to(rewards.dtype)
    count = torch.zeros(num_groups, dtype=rewards.dtype).index_add(0, index, p)
    mean = torch.zeros(num_groups, dtype=rewards.dtype).index_add(0, index, r) / count.clamp(min=1)
    sq = torch.zeros(num_groups, dtype=rewards.dtype).index_add(0, index, ((r - mean[index]) ** 2) * p)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return count, mean, std


def _bnpo_weight(group_mean: Tensor, has_signal: Tensor) -> Tensor:
    """1 / Beta(alpha, beta).pdf(p) per group (BNPO, Xiao et al. 2025, Theorem 2): fit Beta(a, b) to
    the per-prompt accuracies p by moments, then alpha = 1 + a/3, beta = 1 + b/3 (floored at 1).
    With under two prompts, or no spread between them, the fit is undefined: Beta(1, 1) (weight 1,
    plain REINFORCE with the group-mean baseline)."""
    p = group_mean[has_signal] if has_signal.any() else group_mean
    ones = torch.ones_like(group_mean)
    if p.numel() < 2 or float(p.var()) <= 1e-12:
        return ones
    m, v = p.mean(), p.var()
    common = m * (1 - m) / v - 1
    alpha = torch.clamp(1 + common * m / 3, min=1.0)
    beta = torch.clamp(1 + common * (1 - m) / 3, min=1.0)
    density = torch.distributions.Beta(alpha, beta).log_prob(group_mean.clamp(1e-6, 1 - 1e-6)).exp()
    return (1.0 / density).clamp(max=BNPO_MAX_WEIGHT)


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    mode: AdvantageMode = "std",
    *,
    eps: float = 1e-6,
    reward_range: tuple[float, float] = (0.0, 1.0),
) -> Tensor:
    """rewards (B,) float with NaN for missing, group_ids (B,) int -> advantages (B,) float32.

    `reward_range` is only used by "beta": BNPO's theory is for rewards in [0, 1], so rewards are
    mapped affinely from that range first.
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be (B,)")
    rewards = rewards.detach().to(torch.float64).cpu()
    present = ~torch.isnan(rewards)
    _, index = torch.unique(group_ids.cpu(), return_inverse=True)
    num_groups = int(index.max()) + 1 if index.numel() else 0

    if mode == "beta":
        lo, hi = reward_range
        if hi <= lo:
            raise ValueError(f"reward_range must be (low, high) with low < high, got {reward_range}")
        rewards = (rewards - lo) / (hi - lo)
    count, mean, std = _group_stats(rewards, index, num_groups, present)
    has_signal = (count >= 2) & (std > 1e-8)
    centred = torch.where(present, rewards - mean[index], torch.zeros_like(rewards))

    if mode == "std":
        adv = centred / (std[index] + eps)
    elif mode == "no_std":
        adv = centred
    elif mode == "beta":
        adv = centred * _bnpo_weight(mean, has_signal)[index]
    else:
        raise ValueError(f"unknown advantage mode {mode!r}; use 'std', 'no_std' or 'beta'")
    adv = torch.where(has_signal[index] & present, adv, torch.zeros_like(adv))
    return adv.to(torch.float32).to(group_ids.device)
