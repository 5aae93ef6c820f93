"""Objectives built for stale rollouts. Each starts from the token ratio r_t = pi(y_t) / mu(y_t) of the
learner pi against the sampler mu (log r_t = l - s) and decides by its own rule which tokens or
sequences of a stale batch may still move the policy, and how much:

- m2po           M2PO (Zheng, Zhao and Chen, arXiv:2510.01161): masks the tokens that carry the batch's
                 second moment of log r above a budget; no clip.
- decoupled_ppo  AReaL's decoupled PPO (Fu et al., arXiv:2505.24298): PPO's trust region around a
                 proximal policy, times a behaviour weight pi_prox / mu for the staleness.
- tis_mis        token-level truncated importance sampling (Yao et al., "Your efficient RL framework
                 secretly brings you off-policy RL training", 2025) with sequence-level masked
                 importance sampling (verl's Seq-MIS preset).
- opsm           DeepSeek-V3.2's off-policy sequence masking (arXiv:2512.02556, eq. 9) on GRPO.

Not here: VCPO (Huang et al., arXiv:2602.17616). Its formulas are pinned down (its README and paper):
a learning rate scaled by sqrt(ESS / B), ESS = (sum_i w_i)^2 / sum_i w_i^2 over the batch's sequence
ratios, and an off-policy optimal baseline b = sum_i w_i^2 |grad log pi(y_i)|^2 R_i / sum_i w_i^2
|grad log pi(y_i)|^2. Neither is a function of log-prob tensors: the baseline needs each sequence's
own gradient norm (its code runs one backward pass per trajectory and keeps per-trajectory gradient
buffers), and the step scaling changes the optimizer's learning rate, which scaling the loss cannot
do under AdamW (Adam's update is nearly blind to a scale on the gradient). Both belong in the
learner's step (swarm/training.py), not in this registry of pure losses.

The proximal policy. Decoupled PPO needs a third policy besides the learner pi_theta and the sampler
mu: pi_prox, the policy at the start of the current update (AReaL recomputes its log-probs with a
forward pass of the trainer's weights before the PPO minibatch steps). The swarm's learner takes one
optimizer step per batch, so pi_prox is exactly the learner's current version k, and its log-probs are
the learner's own, detached: `LossInputs.proximal_logprobs = None` means that. It costs nothing (no
extra forward pass, no second copy of the weights). What it implies: pi_theta / pi_prox = 1 at the
only point where the gradient is taken, so PPO's clip never acts and decoupled PPO becomes the
behaviour-weighted policy gradient sg(pi_k / mu) * A * grad log pi, with tokens whose weight exceeds
the cap left out. AReaL's clip only bites from the second minibatch step on the same batch; a learner
that takes several would pass the log-probs of its first forward pass (4 bytes per completion token).
Using an older version (k - 1) as pi_prox instead would cost a second model and a forward pass per
step and is not what AReaL does, so it is not offered.

Every objective here is normalised like its source: token means over the batch (M2PO's
1 / sum_i |o_i|, AReaL's and verl's token-mean), except OPSM, which keeps GRPO's mean over each
sequence's tokens, then over sequences. Masks are computed per micro-batch: M2PO's batch-level
second moment is a micro-batch's when the learner splits a batch (the staleness study does not).
"""

from __future__ import annotations

import torch
from torch import Tensor

from swarm.losses.base import (
    LossInputs,
    clamped_exp,
    masked_sum,
    normalise_seq_mean,
    normalise_token_mean,
    per_sequence_mean,
    ppo_clip_objective,
    valid_sequences,
    weighted_mean_var,
)
from swarm.losses.registry import LossConfig, clip_range, register_loss


def _fraction(flags: Tensor, weight: Tensor) -> Tensor:
    """Share of the elements with weight 1 (tokens or sequences) where `flags` is set."""
    return (flags.to(weight.dtype) * weight).sum() / weight.sum().clamp(min=1)


def _token_weight_metrics(log_ratio: Tensor, mask: Tensor) -> dict:
    mean, var = weighted_mean_var(clamped_exp(log_ratio.detach()), mask)
    return {"is_weight_mean": mean, "is_weight_var": var}


# ----------------------------------------------------------------------------------------------
# M2PO: J = 1 / sum_i |o_i| * sum_i sum_t M_it * r_it * A_i (r_it with its gradient, no clip), where
# the mask M comes from the paper's Algorithm 1: over the trust-region tokens T, while
# mean_{t in T} (log r_t)^2 > tau_M2, mask the token with the largest (log r_t)^2 and drop it from T.
# tau_M2 = 0.04 in all of the paper's runs. The paper does not define T beyond its name; its authors'
# code takes the tokens a PPO clip would act on, (A > 0 and r > 1) or (A < 0 and r < 1), and so do
# we (AReaL's M2PO takes every token instead). That code then turns the budget into PPO clip bounds
# (never tighter than 0.3 / 0.5) rather than a mask; we follow the paper's Algorithm 1 and objective.


@torch.no_grad()
def m2po_keep(log_ratio: Tensor, advantages: Tensor, mask: Tensor, threshold: float) -> tuple[Tensor, Tensor]:
    """(B, T) float mask of the tokens M2PO keeps, and the second moment of T before masking.

    Masking the largest value never raises the mean of the rest, so the loop stops after masking the
    k largest for the first k whose remainder's mean is within the budget (all of T if none is)."""
    adv = advantages[:, None]
    trust = (mask > 0) & (((adv > 0) & (log_ratio > 0)) | ((adv < 0) & (log_ratio < 0)))
    keep = torch.ones_like(mask)
    second_moments = log_ratio[trust].square()  # (n,)
    n = second_moments.numel()
    if n == 0:
        return keep, torch.zeros((), dtype=mask.dtype, device=mask.device)
    descending, order = second_moments.sort(descending=True)
    rest_sums = descending.flip(0).cumsum(0).flip(0)  # sum of descending[k:]
    rest_means = rest_sums / torch.arange(n, 0, -1, dtype=rest_sums.dtype, device=rest_sums.device)
    within = (rest_means <= threshold).nonzero()
    k = int(within[0]) if within.numel() else n
    positions = trust.flatten().nonzero().squeeze(1)[order[:k]]
    keep.view(-1)[positions] = 0.0
    return keep, second_moments.mean()


@register_loss(
    "m2po", eps_low=0.0, eps_high=0.0, advantage_mode="std", level="token",
    summary="token ratio, no clip; masks the tokens that push the second moment of log r over 0.04 (Zheng et al., M2PO)",
)
def m2po_loss(inputs: LossInputs, config: LossConfig) -> tuple[Tensor, dict]:
    mask = inputs.mask
    log_ratio = inputs.learner_logprobs - inputs.sampler_logprobs  # (B, T)
    keep, m2 = m2po_keep(log_ratio.detach(), inputs.advantages, mask, config.m2po_threshold)
    objective = keep * clamped_exp(log_ratio) * inputs.advantages[:, None]
    loss = -normalise_token_mean(objective, mask)
    return loss, {**_token_weight_metrics(log_ratio, mask), "clip_frac": _fraction(keep == 0, mask), "m2": m2}


# ----------------------------------------------------------------------------------------------
# Decoupled PPO (AReaL's decoupled objective): J = E_t[ w_t * min(u_t A, clip(u_t, 1 - eps, 1 + eps) A) ] with the
# proximal ratio u_t = pi_theta / pi_prox (with gradient) and the behaviour weight w_t = pi_prox / mu
# (none); eps = 0.2. Tokens with w_t above a cap are left out (AReaL's default: 5, token-level mask),
# still counted in the token-mean's denominator as AReaL does. See the module docstring for pi_prox.


def proximal_logprobs(inputs: LossInputs) -> Tensor:
    """(B, T) log pi_prox: the one given, else the learner's own log-probs, detached."""
    return inputs.learner_logprobs.detach() if inputs.proximal_logprobs is None else inputs.proximal_logprobs


def decoupled_objective(
    inputs: LossInputs, config: LossConfig, behaviour_weight: Tensor, keep: Tensor
) -> tuple[Tensor, Tensor]:
    """Token-mean of keep * w * min(u A, clip(u) A) with u = pi_theta / pi_prox: decoupled PPO's form,
    shared with tis_mis (verl's decoupled mode). Returns the loss and the (B, T) clipped-branch mask."""
    eps_low, eps_high = clip_range(config)
    proximal_ratio = clamped_exp(inputs.learner_logprobs - proximal_logprobs(inputs))
    objective, clipped = ppo_clip_objective(proximal_ratio, inputs.advantages[:, None], eps_low, eps_high)
    return -normalise_token_mean(keep * behaviour_weight * objective, inputs.mask), clipped


@register_loss(
    "decoupled_ppo", eps_low=0.2, eps_high=0.2, advantage_mode="std", level="token",
    summary="PPO clip around the proximal policy times the behaviour weight pi_prox/mu, masked above 5 (AReaL)",
)
def decoupled_ppo_loss(inputs: LossInputs, config: LossConfig) -> tuple[Tensor, dict]:
    mask = inputs.mask
    behaviour_log_ratio = proximal_logprobs(inputs) - inputs.sampler_logprobs  # no gradient
    weight = clamped_exp(behaviour_log_ratio)
    keep = (weight <= config.behaviour_weight_cap).to(mask.dtype)
    loss, clipped = decoupled_objective(inputs, config, weight, keep)
    return loss, {**_token_weight_metrics(behaviour_log_ratio, mask), "clip_frac": _fraction(clipped > 0, mask),
                  "masked_frac": _fraction(keep == 0, mask)}


# ----------------------------------------------------------------------------------------------
# Token-TIS with Seq-MIS, in verl's decoupled mode (its presets decoupled_token_is and
# decoupled_seq_is_rs): J = E_t[ m_i * min(rho_t, C) * min(u_t A, clip(u_t) A) ], rho_t = pi_prox / mu
# per token, truncated at C = 2 (Yao et al.'s TIS and verl's default threshold), and m_i = 1 when the
# whole sequence's ratio rho(y_i) = prod_t rho_t lies in [0.5, 2] (verl's Seq-MIS bounds, its
# seq_sum_k1 rejection), else 0: truncation keeps every token with a bounded weight, the mask drops
# sequences whose joint ratio says they are off-policy as a whole. PPO's eps = 0.2; with pi_prox the
# learner's own log-probs (module docstring), u_t = 1 and this is verl's bypass REINFORCE with the
# same weights.


@register_loss(
    "tis_mis", eps_low=0.2, eps_high=0.2, advantage_mode="std", level="token",
    summary="token weights min(pi/mu, 2), sequences with pi(y)/mu(y) outside [0.5, 2] masked (token-TIS + seq-MIS, verl)",
)
def tis_mis_loss(inputs: LossInputs, config: LossConfig) -> tuple[Tensor, dict]:
    mask = inputs.mask
    log_ratio = proximal_logprobs(inputs) - inputs.sampler_logprobs  # (B, T), no gradient
    ratio = clamped_exp(log_ratio)
    weight = ratio.clamp(max=config.tis_cap)
    sequence_ratio = clamped_exp(masked_sum(log_ratio, mask, -1))  # (B,) the whole sequence's
    kept = (sequence_ratio >= config.mis_low) & (sequence_ratio <= config.mis_high)
    loss, _ = decoupled_objective(inputs, config, weight, kept[:, None].to(mask.dtype))
    return loss, {**_token_weight_metrics(log_ratio, mask), "clip_frac": _fraction(ratio > config.tis_cap, mask),
                  "masked_frac": _fraction(~kept, valid_sequences(mask))}


# ----------------------------------------------------------------------------------------------
# DeepSeek-V3.2's off-policy sequence masking (eq. 9): GRPO's objective (token ratio against the
# sampler, PPO clip eps = 0.2, mean over each sequence's tokens then over sequences) times M_i = 0 when
# A_i < 0 and (1 / |o_i|) sum_t log(mu(y_t) / pi(y_t)) > delta, else 1: a sequence with negative
# advantage that the learner has already moved away from is not pushed down further. The report gives
# no delta; the default 1e-4 is slime's (TRL suggests 0.5 as a starting point), see LossConfig.


@register_loss(
    "opsm", eps_low=0.2, eps_high=0.2, advantage_mode="std", level="token",
    summary="GRPO with negative-advantage sequences masked when mean log(mu/pi) > delta (DeepSeek-V3.2)",
)
def opsm_loss(inputs: LossInputs, config: LossConfig) -> tuple[Tensor, dict]:
    eps_low, eps_high = clip_range(config)
    mask = inputs.mask
    log_ratio = inputs.learner_logprobs - inputs.sampler_logprobs  # (B, T)
    objective, clipped = ppo_clip_objective(clamped_exp(log_ratio), inputs.advantages[:, None], eps_low, eps_high)
    drift = per_sequence_mean(-log_ratio.detach(), mask)  # (B,) mean_t log(mu / pi)
    masked = (inputs.advantages < 0) & (drift > config.opsm_delta)
    loss = -normalise_seq_mean(objective * (~masked)[:, None].to(mask.dtype), mask)
    return loss, {**_token_weight_metrics(log_ratio, mask), "clip_frac": _fraction(clipped > 0, mask),
                  "masked_frac": _fraction(masked, valid_sequences(mask))}
