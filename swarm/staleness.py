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

Any of them may end in "/drop:K" ("uniform:64/drop:8"): groups more than K steps old are dropped, as
prime-rl does by default with K = 8, and the learner waits for fresher ones. A step still trains on
as many groups, so their staleness follows the distribution conditioned on at most K (each draw is
redrawn until it is); what dropping costs is sampling, the share `dropped_fraction()` of all groups.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the ring only holds tensors: importing this module (config's validators do) loads no torch
    import torch


@dataclass(frozen=True)
class DelayDistribution:
    kind: str
    k: int = 0
    low_s: float = 0.0
    high_s: float = 0.0
    step_s: float = 1.0
    drop_over: int | None = None  # groups staler than this many steps are dropped (None: none are)

    @classmethod
    def parse(cls, spec: str) -> "DelayDistribution":
        base, slash, drop = spec.partition("/")
        dist = cls._parse_base(base)
        if not slash:
            return dist
        name, _, k = drop.partition(":")
        if name != "drop" or not k.isdigit():
            raise ValueError(f"bad delay distribution {spec!r}: after '/' write drop:K, the staleness in steps above "
                             "which groups are dropped (e.g. uniform:64/drop:8)")
        if dist.min_steps > int(k):
            raise ValueError(f"delay distribution {spec!r} drops every group: none is ever {k} steps old or fresher; "
                             "raise K or use a distribution with fresher groups")
        return replace(dist, drop_over=int(k))

    @classmethod
    def _parse_base(cls, spec: str) -> "DelayDistribution":
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
            most = 0
        elif self.kind in ("fixed", "uniform"):
            most = self.k
        else:
            most = math.ceil(self.high_s / self.step_s)
        return most if self.drop_over is None else min(most, self.drop_over)

    @property
    def min_steps(self) -> int:
        """The freshest a group can be, before any drop."""
        if self.kind == "fixed":
            return self.k
        if self.kind == "lognormal":
            return int(round(self.low_s / self.step_s))
        return 0

    def dropped_fraction(self) -> float:
        """The share of all groups that are more than `drop_over` steps old and dropped."""
        if self.drop_over is None or self.kind in ("none", "fixed"):  # parse() refused fixed:K/drop:J, J < K
            return 0.0
        if self.kind == "uniform":
            return max(0, self.k - self.drop_over) / (self.k + 1)
        # lognormal: round(X / step_s) > K when X > (K + 1/2) * step_s, X the clipped log-normal delay
        t = (self.drop_over + 0.5) * self.step_s
        if t < self.low_s:
            return 1.0
        if t >= self.high_s:
            return 0.0
        mu, sigma = lognormal_parameters(self.low_s, self.high_s)
        return 0.5 * math.erfc((math.log(t) - mu) / (sigma * math.sqrt(2)))

    def draw(self, rng: random.Random) -> int:
        """Staleness in steps (before capping), redrawn while it exceeds `drop_over`."""
        while True:
            steps = self._draw_once(rng)
            if self.drop_over is None or steps <= self.drop_over:
                return steps

    def _draw_once(self, rng: random.Random) -> int:
        if self.kind == "none":
            return 0
        if self.kind == "fixed":
            return self.k
        if self.kind == "uniform":
            return rng.randint(0, self.k)
        return int(round(lognormal_between(rng, self.low_s, self.high_s) / self.step_s))


def lognormal_parameters(low: float, high: float) -> tuple[float, float]:
    """(mu, sigma) of the paper's delay model: median sqrt(low * high), the bounds at +-2 sigma."""
    return (math.log(low) + math.log(high)) / 2, (math.log(high) - math.log(low)) / 4


def lognormal_between(rng: random.Random, low: float, high: float) -> float:
    """The paper's delay model: log-normal with median sqrt(low * high) and the bounds at +-2 sigma,
    clipped to [low, high]."""
    mu, sigma = lognormal_parameters(low, high)
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
