"""Controlled staleness for experiments: delay distributions and a ring buffer of past policies.

A delay distribution gives, for each rollout group, how many policy versions old its sampler is:
- "none"                         online: always the learner's current version;
- "fixed:K"                      always K steps behind;
- "uniform:K"                    uniform over 0..K steps;
- "lognormal:LO,HI,STEP_S"       the GEPO paper's delay model: a log-normal delay in seconds
                                 clipped to [LO, HI] (paper: 60..1920 s), converted to steps at
                                 STEP_S seconds per learner step. The log-normal's median is the
                                 geometric mean of the bounds and its sigma puts the bounds at
                                 +-2 sigma.
Every draw is capped by the versions that exist (a group cannot come from before version 0) and by
the maximum staleness a learner tolerates.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DelayDistribution:
    kind: str
    k: int = 0
    low_s: float = 0.0
    high_s: float = 0.0
    step_s: float = 1.0

    @classmethod
    def parse(cls, spec: str) -> "DelayDistribution":
        kind, _, args = spec.partition(":")
        try:
            if kind == "none" and not args:
                return cls("none")
            if kind in ("fixed", "uniform"):
                k = int(args)
                if k < 0:
                    raise ValueError
                return cls(kind, k=k)
            if kind == "lognormal":
                low, high, step = (float(x) for x in args.split(","))
                if not 0 < low < high or step <= 0:
                    raise ValueError
                return cls(kind, low_s=low, high_s=high, step_s=step)
        except ValueError:
            pass
        raise ValueError(
            f"bad delay distribution {spec!r}; use 'none', 'fixed:K', 'uniform:K' or 'lognormal:LO,HI,STEP_S' "
            "(e.g. lognormal:60,1920,30)"
        )

    @property
    def max_steps(self) -> int:
        if self.kind == "none":
            return 0
        if self.kind in ("fixed", "uniform"):
            return self.k
        return math.ceil(self.high_s / self.step_s)

    def draw(self, rng: random.Random) -> int:
        """Staleness in steps (before capping)."""
        if self.kind == "none":
            return 0
        if self.kind == "fixed":
            return self.k
        if self.kind == "uniform":
            return rng.randint(0, self.k)
        return int(round(lognormal_between(rng, self.low_s, self.high_s) / self.step_s))


def lognormal_between(rng: random.Random, low: float, high: float) -> float:
    """The paper's delay model: log-normal with median sqrt(low * high) and the bounds at +-2 sigma,
    clipped to [low, high]."""
    mu = (math.log(low) + math.log(high)) / 2
    sigma = (math.log(high) - math.log(low)) / 4
    return min(high, max(low, rng.lognormvariate(mu, sigma)))


@dataclass(frozen=True)
class SecondsDelay:
    """How long a sampler waits before it uses a newly announced version (latency simulation):
    "none", "fixed:S", "uniform:S" (0..S) or "lognormal:LO,HI" (the paper's runs: 60,1920)."""

    kind: str
    low_s: float = 0.0
    high_s: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> "SecondsDelay":
        kind, _, args = spec.partition(":")
        try:
            if kind == "none" and not args:
                return cls("none")
            if kind in ("fixed", "uniform") and float(args) >= 0:
                return cls(kind, high_s=float(args))
            if kind == "lognormal":
                low, high = (float(x) for x in args.split(","))
                if 0 < low < high:
                    return cls(kind, low_s=low, high_s=high)
        except ValueError:
            pass
        raise ValueError(f"bad pickup delay {spec!r}; use 'none', 'fixed:S', 'uniform:S' or 'lognormal:LO,HI' "
                         "in seconds (e.g. lognormal:6,192 for the paper's 60..1920 s scaled down 10x)")

    def draw(self, rng: random.Random) -> float:
        if self.kind == "none":
            return 0.0
        if self.kind == "fixed":
            return self.high_s
        if self.kind == "uniform":
            return rng.uniform(0.0, self.high_s)
        return lognormal_between(rng, self.low_s, self.high_s)


class PolicyRing:
    """The last `capacity` published policy versions, as CPU state dicts (version -> weights)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a policy ring needs room for at least one version")
        self.capacity = capacity
        self._versions: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()

    def publish(self, version: int, model) -> None:
        self._versions[version] = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        while len(self._versions) > self.capacity:
            self._versions.popitem(last=False)

    def get(self, version: int) -> dict[str, torch.Tensor]:
        if version not in self._versions:
            raise KeyError(f"version {version} is not in the ring (holding {list(self._versions)[:1]}..{list(self._versions)[-1:]})")
        return self._versions[version]

    @property
    def oldest(self) -> int:
        return next(iter(self._versions))

    @property
    def newest(self) -> int:
        return next(reversed(self._versions))


def sampler_version(current: int, staleness: int, ring: PolicyRing, max_staleness: int) -> int:
    """The version a group is generated with: `staleness` steps behind, capped by what exists."""
    return max(current - min(staleness, max_staleness), ring.oldest, 0)
