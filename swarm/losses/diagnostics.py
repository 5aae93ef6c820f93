"""Diagnostics of what a clipped objective does with each sign of advantage (GitHub issue #19,
item 4: why GEPO's learner drifts further from its samplers than GRPO's).

Per-loss metrics (`sign_split_metrics`, `token_escape_metrics`, `gepo_weight_metrics`), detached and
cheap, returned with every step's loss metrics by the loss modules that import them. Shares are of
the whole micro-batch (sequences for sequence- and group-level weights, tokens for token-level
ones), so that they add up across micro-batches and `clip_frac == clip_frac_pos + clip_frac_neg`;
the clip fraction among positive-advantage elements is `clip_frac_pos / adv_pos_frac` (a ratio of
sums over steps in a report).

The per-step gradient and movement measures that need the model and every registered loss are
step_diagnostics.py's (`StepDiagnostics`), a module above the losses.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from swarm.losses.base import MAX_LOG_RATIO


@torch.no_grad()
def sign_split_metrics(clipped: Tensor, coefficient: Tensor, advantages: Tensor, weight: Tensor) -> dict[str, Tensor]:
    """How clipping and the gradient divide between positive and negative advantages.

    clipped: float mask of the elements whose clipped branch was taken (no gradient);
    coefficient: each element's gradient coefficient on its log-prob term (weight * A where the
    objective was not clipped, 0 where it was), the same shape;
    advantages: (B,) per sequence; weight: which elements count (valid sequences (B,), or the token
    mask (B, T), in which case a token's coefficient also carries its sequence's 1/length when the
    loss averages over a sequence's tokens - pass it so).

    Returns adv_pos_frac / adv_neg_frac (share of elements with A > 0 / A < 0), clip_frac_pos /
    clip_frac_neg (share of all elements that are clipped and have A > 0 / A < 0), coef_pos_share
    (share of the total |coefficient| from A > 0) and coef_net (sum of coefficients over the sum of
    their magnitudes: 0 when the pushes up and down balance, > 0 when the update raises the
    log-probs of the batch's own completions on balance).
    """
    adv = advantages if clipped.dim() == 1 else advantages[:, None].expand_as(clipped)
    weight = weight.float()
    pos, neg = (adv > 0).float() * weight, (adv < 0).float() * weight
    total = weight.sum().clamp(min=1e-12)
    magnitude = coefficient.abs() * weight
    mass = magnitude.sum()
    return {
        "adv_pos_frac": pos.sum() / total,
        "adv_neg_frac": neg.sum() / total,
        "clip_frac_pos": (clipped * pos).sum() / total,
        "clip_frac_neg": (clipped * neg).sum() / total,
        # no coefficient at all: both numerators are 0 as well, so the clamp makes them 0 without a host sync
        "coef_pos_share": (magnitude * pos).sum() / mass.clamp(min=1e-12),
        "coef_net": (coefficient * weight).sum() / mass.clamp(min=1e-12),
    }


@torch.no_grad()
def token_escape_metrics(inputs, clipped: Tensor, eps_low: float, eps_high: float) -> dict[str, Tensor]:
    """For a sequence-level clip: the tokens whose own ratio r_t = p_t / q_t is past the clip range in
    the direction PPO stops (A > 0 and r_t > 1 + eps_high, or A < 0 and r_t < 1 - eps_low) while their
    sequence is not clipped, so that they keep being pushed further. A token-level clip (GRPO) drops
    exactly these. token_escape_pos / token_escape_neg: shares of all tokens, by sign of advantage
    (they add up to token_escape_frac)."""
    mask = inputs.mask.float()
    log_r = (inputs.learner_logprobs - inputs.sampler_logprobs).detach().float()
    adv = inputs.advantages[:, None]
    up = (adv > 0) & (log_r > math.log1p(eps_high))
    down = (adv < 0) & (log_r < (math.log(1 - eps_low) if eps_low < 1 else -math.inf))
    live = (1 - clipped.float())[:, None] * mask
    total = mask.sum().clamp(min=1)
    pos, neg = (up.float() * live).sum() / total, (down.float() * live).sum() / total
    return {"token_escape_frac": pos + neg, "token_escape_pos": pos, "token_escape_neg": neg}


@torch.no_grad()
def gepo_weight_metrics(learner_seq: Tensor, sampler_seq: Tensor, log_expectation: Tensor, clipped: Tensor,
                        advantages: Tensor, valid: Tensor, eps_low: float, eps_high: float) -> dict[str, Tensor]:
    """GEPO's weight w = p / E_q[q] split into its two factors, w = rho * w0, with rho = p / q the
    sequence's own ratio (how far the learner moved from the sampler on it) and w0 = q / E_q[q] the
    weight the sequence would have on-policy (p = q): w0 is not 1, its mean over a group is
    (sum q)^2 / (G sum q^2) <= 1, and the PPO clip acts on w, so it is centred on E_q[q], not on q.

    Returns (over valid sequences):
    - gepo_w0_mean, gepo_w0_sd: mean and standard deviation of w0;
    - gepo_w0_adv: mean of w0 * A, the net push of the on-policy weight (0 for a weight of 1, since
      advantages sum to 0 in a group; > 0 when the completions with positive advantage are the more
      likely ones);
    - gepo_w0_out: share of sequences whose w0 is already outside [1 - eps_low, 1 + eps_high];
    - seq_log_ratio_abs: mean |log rho| (per token in "mean" mode);
    - trust_escape_frac: share of sequences whose objective is not clipped although their own ratio
      rho is past the clip range in the direction PPO would stop (A > 0 and rho > 1 + eps_high, or
      A < 0 and rho < 1 - eps_low): they keep pushing away from their sampler;
    - clip_by_bias_frac: share clipped although rho is inside the clip range (clipped by w0 alone).
    """
    log_rho = (learner_seq - sampler_seq).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    log_w0 = (sampler_seq - log_expectation).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    w0 = torch.exp(log_w0.double())
    rho = torch.exp(log_rho.double())
    valid = valid.double()
    n = valid.sum().clamp(min=1)
    w0_mean = (w0 * valid).sum() / n
    w0_sd = torch.sqrt((((w0 - w0_mean) ** 2) * valid).sum() / n)
    adv = advantages.double()
    beyond = ((adv > 0) & (rho > 1 + eps_high)) | ((adv < 0) & (rho < 1 - eps_low))
    inside = (rho >= 1 - eps_low) & (rho <= 1 + eps_high)
    clipped = clipped.double()
    out = ((w0 < 1 - eps_low) | (w0 > 1 + eps_high)).double()
    metrics = {
        "gepo_w0_mean": w0_mean,
        "gepo_w0_sd": w0_sd,
        "gepo_w0_adv": (w0 * adv * valid).sum() / n,
        "gepo_w0_out": (out * valid).sum() / n,
        "seq_log_ratio_abs": (log_rho.double().abs() * valid).sum() / n,
        "trust_escape_frac": (beyond.double() * (1 - clipped) * valid).sum() / n,
        "clip_by_bias_frac": (inside.double() * clipped * valid).sum() / n,
    }
    return {k: v.float() for k, v in metrics.items()}
