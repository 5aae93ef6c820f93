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
Last and dearest, a sampled fraction of groups has its behaviour log-probs recomputed at the
claimed version (swarm.verification); a sampler caught lying about them is banned at once, since
an honest one never exceeds the calibrated tolerance."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable, Sequence

from swarm.rewards import RewardScorer
from swarm.rollouts import RolloutGroup
from swarm.tasks.base import cut_at_stop
from swarm.verification import LogprobVerifier

logger = logging.getLogger(__name__)
# a sampler's reward may differ from the learner's by rounding only
REWARD_TOLERANCE = 1e-6


class GroupIntake:
    def __init__(self, answers: dict[str, str], *, decode: Callable[[list[list[int]]], list[str]], max_staleness: int,
                 max_age_s: float, penalise: Callable[[str, str], None], temperature: float, top_k: int = 0,
                 top_p: float = 1.0, scorer: RewardScorer | None = None, verifier: LogprobVerifier | None = None,
                 banned: Callable[[str], bool] = lambda peer: False, stop_strings: Sequence[str] = ()) -> None:
        """answers: problem id -> gold answer. decode: completion token ids -> texts, as samplers decode
        them (the tokenizer's batch_decode without special tokens). penalise(peer, reason, ban=False):
        a strike against the sender (ban: at once). temperature, top_k, top_p: the run's sampling
        settings. verifier: recomputes the log-probs of a fraction of groups (None: none). banned(peer):
        whether a sender is banned now (its groups still queued when the ban came are dropped).
        stop_strings: the run's; a completion is scored up to its first one, and must end there."""
        self.answers, self.max_staleness, self.max_age_s, self.penalise = answers, max_staleness, max_age_s, penalise
        self.decode, self.sampling, self.verifier = decode, (float(temperature), int(top_k), float(top_p)), verifier
        self.banned, self.stop_strings = banned, tuple(stop_strings)
        self.scorer = scorer or RewardScorer()
        self.dropped: Counter = Counter()  # reason -> groups

    def accept(self, group: RolloutGroup, learner_version: int) -> bool:
        """True when `group` may be trained on; its rewards are then the learner's own."""
        try:
            return self._check(group, learner_version)
        except Exception as exc:  # noqa: BLE001  the boundary: whatever a group does, the learner goes on
            logger.warning("refused a group from %s that could not be checked: %s: %s", group.sender, type(exc).__name__, exc)
            self.dropped["could not be checked"] += 1
            self.penalise(group.sender, "could not be checked")
            return False

    def _check(self, group: RolloutGroup, learner_version: int) -> bool:
        if self.banned(group.sender):
            self.dropped["sender banned"] += 1
            return False
        if (group.temperature, group.top_k, group.top_p) != self.sampling:
            self.dropped["other sampling settings"] += 1
            self.penalise(group.sender, "other sampling settings")
            return False
        if learner_version - group.version > self.max_staleness:
            self.dropped["too stale"] += 1
            return False
        if time.time() - group.created_at > self.max_age_s:
            self.dropped["too old"] += 1
            return False
        gold = self.answers.get(group.problem_id)
        if gold is None:
            self.dropped["unknown problem"] += 1
            self.penalise(group.sender, "unknown problem")
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
        if self.verifier is not None and self.verifier.chosen():
            refused = self.verifier.check(group)
            if refused == "version not held":  # from before a restart: nobody's fault, and not checkable
                self.dropped["version not held"] += 1
                return False
            if refused:
                self.dropped["log-prob mismatch"] += 1
                logger.warning("refused a group from %s: %s; banning it", group.sender, refused)
                self.penalise(group.sender, refused, ban=True)
                return False
        group.rewards, group.completion_texts = rescored, texts
        return True

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
