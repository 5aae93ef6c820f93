"""What a learner accepts into a training batch. The inbox (fabric) has already validated the wire
form; here each group is checked against the learner's own state: how stale and how old it is,
whether its problem is one of the task's, and whether its rewards match the learner's own scoring
of the completions. The learner decodes the completion token ids itself and scores that text, so
neither a sampler's rewards nor its texts are trusted: the tokens trained on are the tokens scored.
Groups must have been sampled with the run's settings (temperature, top-k, top-p): a learner steps
on one sampling distribution, and a group claiming, say, temperature 1e-40 would make its
log-probs non-finite. Every refusal is counted by reason; refusals that are the sender's fault are
reported to the inbox, which bans repeat offenders (stale groups are never the sender's fault). A
group that makes a check itself fail is refused as the sender's fault too, never ends the learner.
A group's prompt tokens must be the prompt the learner's own task builds for its problem id: the
gold answer is looked up by id, so a group pairing a real id with another prompt would teach that
id's answer on any prompt (issue 45). A group whose content (prompt and completions) the learner
already accepted within the staleness window is refused whatever its id (swarm.replays), without a
strike: two honest samplers at temperature 0 may write the same group.
Last and dearest, a sampled fraction of groups has its behaviour log-probs recomputed at the
claimed version (swarm.verification); a group over the tolerance is refused, and its sender banned
once its checked groups show it is not an honest sampler (verification.GapEvidence). A group
chosen for checking at an old version that is being rebuilt in the background (VersionStore.state_now)
is deferred, not trained on unchecked: `resume` checks it once its version is ready (all checks
again, at the learner's version then), and one that goes past the staleness limit or MAX_DEFERRED
while waiting is dropped by reason, without blame.
Groups accepted into a batch whose step did not happen (the learner took another learner's state
instead: swarm.training.OutOfStep) are held over for the next step (`hold_over`), not thrown away:
they passed every check, and the loss takes their one more step of staleness."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable, Mapping, Sequence

from swarm.replays import SeenContent
from swarm.rewards import RewardScorer
from swarm.rollouts import RolloutGroup
from swarm.tasks.base import cut_at_stop
from swarm.verification import REBUILDING, LogprobVerifier

logger = logging.getLogger(__name__)
# a sampler's reward may differ from the learner's by rounding only
REWARD_TOLERANCE = 1e-6
# the most groups waiting for their version's background rebuild to be checked (beyond: dropped)
MAX_DEFERRED = 64


class GroupIntake:
    def __init__(self, answers: dict[str, str], *, decode: Callable[[list[list[int]]], list[str]], max_staleness: int,
                 max_age_s: float, penalise: Callable[[str, str], None], temperature: float, top_k: int = 0,
                 top_p: float = 1.0, scorer: RewardScorer | None = None, verifier: LogprobVerifier | None = None,
                 banned: Callable[[str], bool] = lambda peer: False, stop_strings: Sequence[str] = (),
                 prompts: Mapping[str, str] | None = None, encode: Callable[[str], list[int]] | None = None) -> None:
        """answers: problem id -> gold answer. decode: completion token ids -> texts, as samplers decode
        them (the tokenizer's batch_decode without special tokens). penalise(peer, reason, ban=False):
        a strike against the sender (ban: at once). temperature, top_k, top_p: the run's sampling
        settings. verifier: recomputes the log-probs of a fraction of groups (None: none). banned(peer):
        whether a sender is banned now (its groups still queued when the ban came are dropped).
        stop_strings: the run's; a completion is scored up to its first one, and must end there.
        prompts: problem id -> the prompt text the task builds for it, and encode: that text -> its
        token ids, as samplers tokenize it (the tokenizer's call with special tokens); with both, a
        group's prompt tokens must be its problem's (None: not checked)."""
        self.answers, self.max_staleness, self.max_age_s, self.penalise = answers, max_staleness, max_age_s, penalise
        self.decode, self.sampling, self.verifier = decode, (float(temperature), int(top_k), float(top_p)), verifier
        self.banned, self.stop_strings = banned, tuple(stop_strings)
        if (prompts is None) != (encode is None):
            raise ValueError("checking prompts needs both the task's prompts and the tokenizer's encode")
        self.prompts, self.encode = prompts, encode
        self._prompt_ids: dict[str, tuple[int, ...]] = {}  # problem id -> its prompt's tokens, encoded once
        self.seen = SeenContent(window=max_staleness)
        self.scorer = scorer or RewardScorer()
        self.dropped: Counter = Counter()  # reason -> groups
        self.deferred: list[RolloutGroup] = []  # chosen for checking, waiting for their version's rebuild
        self.deferrals = 0  # groups deferred so, in all
        self.held: list[RolloutGroup] = []  # accepted into a step that did not happen, for the next one
        self.held_over = 0  # groups held over so, in all

    def accept(self, group: RolloutGroup, learner_version: int, *, verify: bool | None = None) -> bool:
        """True when `group` may be trained on; its rewards are then the learner's own. False too
        when it is deferred (its log-probs are to be checked at a version being rebuilt: `resume`).
        verify: whether its log-probs are checked (None: drawn, for a `verifier.fraction` of groups)."""
        try:
            return self._check(group, learner_version, verify)
        except Exception as exc:  # noqa: BLE001  the boundary: whatever a group does, the learner goes on
            logger.warning("refused a group from %s that could not be checked: %s: %s", group.sender, type(exc).__name__, exc)
            self.dropped["could not be checked"] += 1
            self.penalise(group.sender, "could not be checked")
            return False

    def resume(self, learner_version: int, limit: int | None = None) -> list[RolloutGroup]:
        """Deferred groups whose version is now ready, checked (the draw stands: each is verified)
        and accepted, up to `limit` (the rest wait on); those too stale or too old by now are dropped
        (nobody's fault: their versions took long to rebuild), as are those whose version could not
        be rebuilt (a bug, said in the log; not the sender's fault either)."""
        accepted, waiting, given_up = [], [], set()
        for group in self.deferred:
            if learner_version - group.version > self.max_staleness or time.time() - group.created_at > self.max_age_s:
                self.dropped["stale before its version was rebuilt"] += 1
                given_up.add(group.version)
                continue
            if limit is not None and len(accepted) >= limit:
                waiting.append(group)
                continue
            try:
                ready = self.verifier.ready(group.version)
            except Exception as exc:  # noqa: BLE001  the boundary: a rebuild that failed drops its groups, the learner goes on
                logger.warning("version %d could not be rebuilt to check a group from %s: %s: %s", group.version,
                               group.sender, type(exc).__name__, exc)
                self.dropped["version could not be rebuilt"] += 1
                continue
            if not ready:
                waiting.append(group)
                continue
            self.deferred = waiting  # (a group deferred again by its check joins the waiting ones)
            if self.accept(group, learner_version, verify=True):
                accepted.append(group)
            waiting = self.deferred
        self.deferred = waiting
        for version in given_up - {group.version for group in waiting}:
            self.verifier.release(version)  # rebuilt for nobody: its room goes to the versions still waited for
        return accepted

    def hold_over(self, groups: Sequence[RolloutGroup]) -> None:
        """Keep `groups`, accepted into a batch whose step did not happen, for the next step
        (`take_held`): samplers' work that passed every check is not thrown away."""
        self.held.extend(groups)
        self.held_over += len(groups)

    def take_held(self, learner_version: int, limit: int) -> list[RolloutGroup]:
        """Up to `limit` held-over groups, oldest first (the rest wait on); those too stale or too
        old by now are dropped by those reasons, as at acceptance (nobody's fault)."""
        fresh = []
        for group in sorted(self.held, key=lambda g: g.version):  # (stable: arrival order within a version)
            expired = self._expired(group, learner_version)
            if expired:
                self.dropped[expired] += 1
            else:
                fresh.append(group)
        taken, self.held = fresh[:max(0, limit)], fresh[max(0, limit):]
        return taken

    def _expired(self, group: RolloutGroup, learner_version: int) -> str | None:
        """Why `group` is past use at `learner_version` ("too stale", "too old"), or None."""
        if learner_version - group.version > self.max_staleness:
            return "too stale"
        if time.time() - group.created_at > self.max_age_s:
            return "too old"
        return None

    def _defer(self, group: RolloutGroup) -> None:
        if len(self.deferred) >= MAX_DEFERRED:
            self.dropped["too many waiting for a rebuilt version"] += 1
            return
        self.deferred.append(group)
        self.deferrals += 1

    def _check(self, group: RolloutGroup, learner_version: int, verify: bool | None = None) -> bool:
        if self.banned(group.sender):
            self.dropped["sender banned"] += 1
            return False
        if (group.temperature, group.top_k, group.top_p) != self.sampling:
            self.dropped["other sampling settings"] += 1
            self.penalise(group.sender, "other sampling settings")
            return False
        expired = self._expired(group, learner_version)
        if expired:
            self.dropped[expired] += 1
            return False
        gold = self.answers.get(group.problem_id)
        if gold is None:
            self.dropped["unknown problem"] += 1
            self.penalise(group.sender, "unknown problem")
            return False
        if not self._own_prompt(group):
            self.dropped["prompt not its problem's"] += 1
            self.penalise(group.sender, "prompt not its problem's")
            return False
        if self.seen.seen(group, learner_version):
            self.dropped["same content as an accepted group"] += 1
            return False
        texts = self.decode(group.completion_ids)
        if self.stop_strings and self._runs_past_stop(group, texts):
            self.dropped["tokens past a stop string"] += 1
            self.penalise(group.sender, "tokens past a stop string")
            return False
        rescored = self.scorer.score([cut_at_stop(t, self.stop_strings) for t in texts], [gold] * group.size)
        if any(a is not None and b is not None and abs(a - b) > REWARD_TOLERANCE for a, b in zip(rescored, group.rewards)):
            self.dropped["reward mismatch"] += 1
            self.penalise(group.sender, "reward mismatch")
            return False
        if self.verifier is not None and (self.verifier.chosen() if verify is None else verify):
            refused = self.verifier.check(group)
            if refused == REBUILDING:  # its version is rebuilt in the background: checked later, never trained on unchecked
                self._defer(group)
                return False
            if refused == "version not held":  # from before a restart: nobody's fault, and not checkable
                self.dropped["version not held"] += 1
                return False
            if self.verifier.convicts(group.sender, refused is not None):
                logger.warning("refused a group from %s: %s; banning it (%d of its last %d checked groups refused)",
                               group.sender, refused, self.verifier.evidence.ban_after, self.verifier.evidence.window)
                self.dropped["log-prob mismatch"] += 1
                self.penalise(group.sender, refused, ban=True)
                return False
            if refused:
                self.dropped["log-prob mismatch"] += 1
                logger.warning("refused a group from %s: %s", group.sender, refused)
                return False
        group.rewards, group.completion_texts = rescored, texts
        self.seen.remember(group, learner_version)
        return True

    def _own_prompt(self, group: RolloutGroup) -> bool:
        """Whether the group's prompt tokens are those of the prompt the task builds for its problem."""
        if self.prompts is None:
            return True
        expected = self._prompt_ids.get(group.problem_id)
        if expected is None:
            expected = self._prompt_ids[group.problem_id] = tuple(self.encode(self.prompts[group.problem_id]))
        return tuple(group.prompt_ids) == expected

    def _runs_past_stop(self, group: RolloutGroup, texts: list[str]) -> bool:
        """Whether a completion goes on after the token that completes a stop string: what follows
        would be trained on and never scored. (Samplers cut there: swarm.sampling.truncate_at_stop.)"""
        for ids, text in zip(group.completion_ids, texts):
            if cut_at_stop(text, self.stop_strings) != text:
                before = self.decode([ids[:-1]])[0]
                if cut_at_stop(before, self.stop_strings) != before:
                    return True
        return False

    def close(self) -> None:
        self.scorer.close()
