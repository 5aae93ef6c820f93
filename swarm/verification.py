"""Verification of the behaviour log-probs (q) that samplers report.

Every importance weight a learner computes divides by q, so a sampler that reports a smaller q
than it sampled from inflates its own groups' weights and steers the step. A learner holds the
versions it published (the VersionStore it serves them from), so it can recompute q: for a
sampled fraction of groups it loads the claimed version into a second copy of the policy, takes the
log-probs of the group's completion tokens under the group's sampling settings (the same
computation as the learner's own, swarm.logprobs), and compares.

The statistic is the largest, over the group's completions, of the mean absolute per-token gap
|q_claimed - q_recomputed|. A sampler that stays within a tolerance t shifts every completion's
mean log-ratio (the sequence log-prob GEPO, GSPO and GMPO use with seq_logprob_mode="mean") by at
most t, so it can move a sequence's importance weight by a factor of at most e^t: within PPO's
clip range for t = 0.1. (With seq_logprob_mode="sum" the bound is e^(t * length).) The default
tolerance is calibrated on honest samplers in float32, bfloat16 and float16
(benchmarks/logprob_tolerance.py).

A version no longer held (older than the learner's store, e.g. from before a restart) cannot be
checked: a group selected for checking at such a version is dropped, without blame.

Related work: INTELLECT-2's TOPLOC and grail commit to the sampler's activations or hidden states
so that a verifier can check a rollout with a cheap prefill instead of trusting it; here the
learner has the weights and simply recomputes, which needs no change on the sampler's side.
"""

from __future__ import annotations

import copy
import random
import threading
import time
from typing import Mapping

import torch

from swarm.config import LearnerConfig, default_of
from swarm.logprobs import MIN_LOGPROB, completion_logprobs
from swarm.rollouts import RolloutGroup, collate


def completion_gaps(claimed: torch.Tensor, recomputed: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) mean absolute per-token gap of each completion (0 for an empty one).

    Tokens the learner's own top-k / top-p filter removes (recomputed at the MIN_LOGPROB floor)
    are left out: a sampler in reduced precision keeps a borderline token that float32 filters
    out (3-5% of bf16/fp16 groups at top-p 0.9 in benchmarks/logprob_tolerance.py), and whatever
    q it claims for such a token, the learner's p is ~0 there, so its importance weight cannot be
    inflated by lying about it."""
    mask = mask * (recomputed > MIN_LOGPROB / 2)
    diff = (claimed - recomputed).abs() * mask
    return diff.sum(-1) / mask.sum(-1).clamp(min=1)


class LogprobVerifier:
    """Recomputes q for a fraction of groups at their claimed version.

    model: the learner's policy (copied once: the copy holds whichever version is being checked).
    states: version -> weights, the versions the learner holds (its VersionStore.states, which
    rebuilds an older version on demand; thread-safe itself); `lock` guards loading the copy.
    fraction: the share of groups checked. tolerance: see the module docstring."""

    def __init__(self, model, states: Mapping[int, Mapping[str, torch.Tensor]], *, lock=None, pad_token_id: int,
                 fraction: float = default_of(LearnerConfig, "verify_fraction"),
                 tolerance: float = default_of(LearnerConfig, "verify_tolerance"), seed: int = 0) -> None:
        if not 0 <= fraction <= 1:
            raise ValueError(f"verification fraction {fraction} must be in [0, 1]")
        self.states, self.lock, self.pad_token_id = states, lock or threading.Lock(), pad_token_id
        self.fraction, self.tolerance = fraction, tolerance
        self.rng = random.Random(seed)
        self.model = copy.deepcopy(model).eval().requires_grad_(False) if fraction > 0 else None
        self.loaded: int | None = None  # the version the copy holds
        self.checked = 0
        self.seconds = 0.0
        self.largest_honest_gap = 0.0  # the largest gap among groups that passed: how close honest peers come

    def chosen(self) -> bool:
        return self.fraction > 0 and self.rng.random() < self.fraction

    def check(self, group: RolloutGroup) -> str | None:
        """None when the group's q matches its claimed version, else the reason to refuse it
        ("version not held" is nobody's fault)."""
        started = time.perf_counter()
        try:
            if group.version not in self.states:
                return "version not held"
            if self.loaded != group.version:  # (a held version may be rebuilt for this: the copy keeps the last one)
                try:
                    state = self.states[group.version]
                except KeyError:  # dropped meanwhile
                    return "version not held"
                with self.lock:
                    self.model.load_state_dict(state, strict=True)
                    self.loaded = group.version
            gap = self.gap(group)
        finally:
            self.seconds += time.perf_counter() - started
        self.checked += 1
        if gap > self.tolerance:
            return f"log-probs do not match version {group.version} (gap {gap:.3g} > {self.tolerance:g})"
        self.largest_honest_gap = max(self.largest_honest_gap, gap)
        return None

    @torch.no_grad()
    def gap(self, group: RolloutGroup) -> float:
        """The group's largest per-completion gap under the weights the copy holds now."""
        batch = collate([group], self.pad_token_id)
        device = next(self.model.parameters()).device
        recomputed = completion_logprobs(
            self.model, batch.prompt_ids.to(device), batch.prompt_mask.to(device), batch.completion_ids.to(device),
            batch.completion_mask.to(device), temperature=group.temperature, top_k=group.top_k, top_p=group.top_p,
        ).float().cpu()
        return float(completion_gaps(batch.sampler_logprobs, recomputed, batch.completion_mask).max())
