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

Which groups are checked is drawn from the operating system's randomness (random.SystemRandom),
never from --seed: with a seeded generator a sampler that knew the seed lied exactly in the groups
left unchecked (issue 45). A group over the tolerance is refused; its sender is banned only on
evidence that its gaps are not an honest sampler's (GapEvidence: `ban_after` refusals among its
last `window` checked groups), since an honest bf16 GPU sampler has come within 0.041 of 0.1.

The check rate and the ban rule, so that a liar is banned within 16 of its lying groups with
probability >= 99% whatever it knows (it cannot know which groups are checked, so each of its
groups is checked independently with probability f). A lie of 0.2 or more exceeds the tolerance
whenever it is checked (honest gaps stay below 0.05). With ban_after = 2, the liar goes unbanned
after 16 lying groups only when at most one of them was checked:
    P = (1 - f)^16 + 16 f (1 - f)^15;  f = 0.4: 0.6^16 + 6.4 * 0.6^15 = 0.00028 + 0.00301 = 0.0033,
so it is banned with probability 0.9967 (f = 0.35 would give 0.9902, f = 0.25 with ban_after = 1,
the old rule, 0.990). That holds while its 16 lying groups fall within 64 of its checked groups
(about 160 groups at f = 0.4); a liar that spaces its lies further apart lies in under one group in
ten, and an unchecked lie cannot steer a step more than an honest group does (the KL penalty's
clamp, swarm.losses.kl; TOPR truncates the weight of negative-advantage sequences at 1). An honest
sampler whose groups exceed with probability p is banned in a window of 64 checks with probability
at most C(64, 2) p^2 = 2016 p^2; benchmarks/ban_rate.py measures p on real bf16 / fp16 numerics and
runs the rule on both honest samplers and liars.

A version no longer held (older than the learner's store, e.g. from before a restart) cannot be
checked: a group selected for checking at such a version is dropped, without blame.

A held version older than a few undo deltas from one held whole is rebuilt in the background
(VersionStore.state_now; 83 s for the oldest of 65 at Qwen3-0.6B shape on a busy machine), not in
the training thread: `check` answers REBUILDING, and the intake defers the group (never trains on
it unverified) until the version is ready (swarm.intake).

Related work: INTELLECT-2's TOPLOC and grail commit to the sampler's activations or hidden states
so that a verifier can check a rollout with a cheap prefill instead of trusting it; here the
learner has the weights and simply recomputes, which needs no change on the sampler's side.
"""

from __future__ import annotations

import copy
import random
import threading
import time
from collections import OrderedDict, deque
from typing import Mapping

import torch

from swarm.config import LearnerConfig, default_of
from swarm.logprobs import MIN_LOGPROB, completion_logprobs
from swarm.rollouts import RolloutGroup, collate
from swarm.lora import load_policy_state


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


# check's answer while the group's version is being rebuilt in the background: ask again later
REBUILDING = "version being rebuilt"
# at most this many senders' recent check results are kept (identities are free to make)
MAX_SENDERS_TRACKED = 10_000


class GapEvidence:
    """Per sender, whether each of its last `window` checked groups was over the tolerance; a
    sender with `ban_after` of them is a liar (see the module docstring for the arithmetic)."""

    def __init__(self, *, ban_after: int = default_of(LearnerConfig, "verify_ban_after"),
                 window: int = default_of(LearnerConfig, "verify_ban_window"), max_senders: int = MAX_SENDERS_TRACKED) -> None:
        if not 1 <= ban_after <= window:
            raise ValueError(f"verify_ban_after {ban_after} must be between 1 and verify_ban_window {window}: "
                             "a ban counts groups over the tolerance among that many checked groups")
        self.ban_after, self.window, self.max_senders = ban_after, window, max_senders
        self._recent: OrderedDict[str, deque] = OrderedDict()  # sender -> deque of bools (True: over the tolerance)

    def record(self, sender: str, over: bool) -> bool:
        """Add one checked group of `sender`'s; True when its record now shows a liar (the record is
        then cleared: a ban expires, and a peer that comes back starts over)."""
        recent = self._recent.pop(sender, None) or deque(maxlen=self.window)
        recent.append(over)
        if over and sum(recent) >= self.ban_after:
            return True
        self._recent[sender] = recent  # most recently checked last
        while len(self._recent) > self.max_senders:
            self._recent.popitem(last=False)
        return False

    def exceedances(self, sender: str) -> int:
        return sum(self._recent.get(sender, ()))


class LogprobVerifier:
    """Recomputes q for a fraction of groups at their claimed version.

    model: the learner's policy (copied once: the copy holds whichever version is being checked).
    states: version -> weights, the versions the learner holds (its VersionStore.states, which
    rebuilds an older version on demand, thread-safe itself, and whose `now` answers None rather
    than wait for a long rebuild; a plain mapping is always ready); `lock` guards loading the copy.
    fraction: the share of groups checked, each drawn independently from the OS's randomness.
    tolerance: see the module docstring. evidence: the ban rule (GapEvidence)."""

    def __init__(self, model, states: Mapping[int, Mapping[str, torch.Tensor]], *, lock=None, pad_token_id: int,
                 fraction: float = default_of(LearnerConfig, "verify_fraction"),
                 tolerance: float = default_of(LearnerConfig, "verify_tolerance"), evidence: GapEvidence | None = None) -> None:
        if not 0 <= fraction <= 1:
            raise ValueError(f"verification fraction {fraction} must be in [0, 1]")
        self.states, self.lock, self.pad_token_id = states, lock or threading.Lock(), pad_token_id
        self.fraction, self.tolerance = fraction, tolerance
        self.evidence = evidence or GapEvidence()
        self.rng = random.SystemRandom()  # not --seed: a sampler must not know which of its groups are checked
        self.model = copy.deepcopy(model).eval().requires_grad_(False) if fraction > 0 else None
        self.loaded: int | None = None  # the version the copy holds
        self.checked = 0
        self.seconds = 0.0
        self.largest_honest_gap = 0.0  # the largest gap among groups that passed: how close honest peers come
        self.largest_gap = 0.0  # the largest of all, refused ones included

    def chosen(self) -> bool:
        return self.fraction > 0 and self.rng.random() < self.fraction

    def check(self, group: RolloutGroup) -> str | None:
        """None when the group's q matches its claimed version, else the reason to refuse it
        ("version not held" is nobody's fault), or REBUILDING: the version is being rebuilt in
        the background, nothing was checked (ask again once `ready`)."""
        started = time.perf_counter()
        try:
            if group.version not in self.states:
                return "version not held"
            if self.loaded != group.version:  # (a held version may be rebuilt for this: the copy keeps the last one)
                now = getattr(self.states, "now", None)
                try:
                    state = now(group.version) if now is not None else self.states[group.version]
                except KeyError:  # dropped meanwhile
                    return "version not held"
                if state is None:  # an old version: rebuilt in the background, not in this (the training) thread
                    return REBUILDING
                with self.lock:
                    load_policy_state(self.model, state)  # a tied parameter once, or a LoRA run's adapter
                    self.loaded = group.version
            gap = self.gap(group)
        finally:
            self.seconds += time.perf_counter() - started
        self.checked += 1
        self.largest_gap = max(self.largest_gap, gap)
        if gap > self.tolerance:
            return f"log-probs do not match version {group.version} (gap {gap:.3g} > {self.tolerance:g})"
        self.largest_honest_gap = max(self.largest_honest_gap, gap)
        return None

    def ready(self, version: int) -> bool:
        """Whether `check` of a group at `version` would not answer REBUILDING (the copy holds it, or
        the store gives it without a long rebuild, or it is not held at all). When it would, the
        version's rebuild is asked for again (a no-op while it is under way): what was rebuilt for
        it may have been dropped unread, and a group must not wait for a rebuild nobody does."""
        available = getattr(self.states, "available_now", None)
        if self.loaded == version or available is None or available(version):
            return True
        self.states.now(version)
        return False

    def release(self, version: int) -> None:
        """No group waits for `version` any more: its rebuild is not needed (HeldStates.release)."""
        release = getattr(self.states, "release", None)
        if release is not None:
            release(version)

    def convicts(self, sender: str, refused: bool) -> bool:
        """Records a checked group of `sender`'s (refused: over the tolerance); True when that makes
        it a liar to ban."""
        return self.evidence.record(sender, refused)

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
