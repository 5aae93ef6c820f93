"""Sampler-learner KL: the k3 penalty the GEPO paper's heterogeneous runs add to the loss, and the
KL(sampler || learner) diagnostic every loss reports."""

from __future__ import annotations

import torch
from torch import Tensor

from swarm.config import LossConfig, default_of
from swarm.losses.base import MAX_LOG_RATIO, local_token_mean, normalise_token_mean


def k3(log_ratio: Tensor) -> Tensor:
    """exp(x) - x - 1 elementwise, written expm1(x) - x: near on-policy (|x| ~ 0.01) exp(x) - 1 cancels
    in float32 and loses most digits of a value ~x^2/2 (a per-token relative error of 1e-4 to 1, against
    1e-6 to 1e-4 here)."""
    return torch.expm1(log_ratio) - log_ratio


def k3_penalty(learner_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor,
               max_log_ratio: float = default_of(LossConfig, "max_claimed_log_ratio")) -> Tensor:
    """Token-mean of exp(s - l) - (s - l) - 1 (Schulman's k3 estimator, >= 0), with gradient through
    the learner log-probs l. Added to the loss with coefficient `beta` (LossConfig; paper: 0.005).

    s is what a sampler claims, and only a fraction of groups is checked (swarm.verification), so
    s - l is clamped per token to +/- `max_log_ratio`: a token's gradient is then at most
    e^max_log_ratio - 1 (6.4 at 2 nats) instead of e^20. Departure from the paper, which trusts its
    own samplers: one group claiming s = 0 on tokens the policy gives e^-10 took a step's gradient
    norm from 7.8 to 17,490 and the step's direction with it (issue 45; tests/learning/test_verification.py).
    Tokens beyond the clamp get no KL gradient (torch's clamp), which an honest group at high
    staleness loses on few tokens."""
    d = (sampler_logprobs - learner_logprobs).clamp(-max_log_ratio, max_log_ratio)
    return normalise_token_mean(k3(d), mask)


@torch.no_grad()
def kl_sampler_learner(learner_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token KL(q || p) estimated on tokens drawn from the sampler q: E_q[r - 1 - log r] with
    r = p / q is unbiased and never negative (k3 with the ratio the right way round)."""
    log_r = (learner_logprobs - sampler_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return local_token_mean(k3(log_r), mask)


@torch.no_grad()
def kl_learner_sampler(learner_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token KL(p || q), the GEPO paper's staleness diagnostic, estimated on tokens drawn from
    q by importance weighting: E_q[r log r] with r = p / q."""
    log_r = (learner_logprobs - sampler_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return local_token_mean(torch.exp(log_r) * log_r, mask)
