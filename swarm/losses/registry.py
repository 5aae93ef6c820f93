"""The loss registry: one name -> one pure function, one dispatch point (`compute_loss`).

Each loss is registered with its own defaults (clip range, which advantage normalisation its paper
uses), so callers pick a loss by name and get that paper's setting unless they override it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Literal

import torch

from swarm.config import LOSS_NAMES, LossConfig
from swarm.losses.base import LossInputs, LossOutputs
from swarm.losses.kl import k3_penalty, kl_learner_sampler, kl_sampler_learner

AdvantageMode = Literal["std", "no_std", "beta"]
WeightLevel = Literal["token", "sequence", "group"]


LossFn = Callable[[LossInputs, LossConfig], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class LossSpec:
    fn: LossFn
    eps_low: float
    eps_high: float
    advantage_mode: AdvantageMode  # the advantage normalisation the loss's paper uses
    level: WeightLevel  # where its importance weight lives
    summary: str


LOSSES: dict[str, LossSpec] = {}


def register_loss(
    name: str, *, eps_low: float, eps_high: float, advantage_mode: AdvantageMode, level: WeightLevel, summary: str
) -> Callable[[LossFn], LossFn]:
    def decorate(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is registered twice")
        if name not in LOSS_NAMES:  # the config's choice list must know every loss
            raise ValueError(f"loss {name!r} is not listed in swarm.config.LOSS_NAMES; add it there")
        LOSSES[name] = LossSpec(fn, eps_low, eps_high, advantage_mode, level, summary)
        return fn

    return decorate


def clip_range(config: LossConfig) -> tuple[float, float]:
    """(epsilon, epsilon_high) of `config`, each unset bound taken from the loss's own defaults."""
    spec = LOSSES[config.name]
    low = spec.eps_low if config.epsilon is None else config.epsilon
    high = spec.eps_high if config.epsilon_high is None else config.epsilon_high
    return low, high


def compute_loss(inputs: LossInputs, config: LossConfig | None = None) -> LossOutputs:
    """The one dispatch point: policy loss + k3 KL penalty, with metrics.

    Metrics (all detached scalars): `loss`, `policy_loss`, `is_weight_mean` / `is_weight_var` (at the
    loss's own level: token, sequence or group), `clip_frac`, `kl_sampler_learner`, `kl_learner_sampler`, `kl_penalty`.
    """
    config = config or LossConfig()
    inputs.validate()
    # Upcast once: losses run in float32 whatever the log-prob dtype (bf16 loses ~3 digits and
    # would make exp() of a log-ratio visibly wrong). The cast keeps the autograd link.
    mask = inputs.mask.to(torch.float32)
    cast = LossInputs(
        learner_logprobs=inputs.learner_logprobs.float(),
        sampler_logprobs=inputs.sampler_logprobs.detach().float(),
        mask=mask,
        advantages=inputs.advantages.detach().float(),
        group_ids=inputs.group_ids,
        proximal_logprobs=None if inputs.proximal_logprobs is None else inputs.proximal_logprobs.detach().float(),
    )
    # q is a sampler's claim, checked for a fraction of groups only: a weight p / q is never taken
    # with q below p * e^-max_claimed_log_ratio, so an unchecked claim of a tiny q cannot make a
    # token's weight more than e^2 = 7.4 (PPO's min lets r * A through unbounded for A < 0; a cap
    # like dual-clip PPO's, Ye et al. 2020, c = 3). Diagnostics below still see the claims as sent.
    bounded = torch.maximum(cast.sampler_logprobs, cast.learner_logprobs.detach() - config.max_claimed_log_ratio)
    policy_loss, metrics = LOSSES[config.name].fn(dataclasses.replace(cast, sampler_logprobs=bounded), config)
    kl_pen = k3_penalty(cast.learner_logprobs, cast.sampler_logprobs, mask, config.max_claimed_log_ratio)
    loss = policy_loss + config.beta * kl_pen if config.beta > 0 else policy_loss
    metrics = {k: v.detach() for k, v in metrics.items()}
    metrics.update(
        loss=loss.detach(),
        policy_loss=policy_loss.detach(),
        kl_penalty=kl_pen.detach(),
        kl_sampler_learner=kl_sampler_learner(cast.learner_logprobs, cast.sampler_logprobs, mask),
        kl_learner_sampler=kl_learner_sampler(cast.learner_logprobs, cast.sampler_logprobs, mask),
    )
    return LossOutputs(loss=loss, metrics=metrics)
