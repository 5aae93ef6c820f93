"""What a learner accepts into a training batch. The inbox (fabric) has already validated the wire
form; here each group is checked against the learner's own state: how stale and how old it is,
whether its problem is one of the task's, and whether its rewards match the learner's own scoring
of the completions. The learner decodes the completion token ids itself and scores that text, so
neither a sampler's rewards nor its texts are trusted: the tokens trained on are the tokens scored.
Every refusal is counted by reason; refusals that are the sender's fault are reported to the
inbox, which bans repeat offenders (stale groups are never the sender's fault)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable

from swarm.rewards import RewardScorer
from swarm.rollouts import RolloutGroup

# a sampler's reward may differ from the learner's by rounding only
REWARD_TOLERANCE = 1e-6


class GroupIntake:
    def __init__(self, answers: dict[str, str], *, decode: Callable[[list[list[int]]], list[str]], max_staleness: int,
                 max_age_s: float, penalize: Callable[[str, str], None], scorer: RewardScorer | None = None) -> None:
        """answers: problem id -> gold answer. decode: completion token ids -> texts, as samplers decode
        them (the tokenizer's batch_decode without special tokens). penalize(peer, reason): a strike
        against the sender."""
        self.answers, self.max_staleness, self.max_age_s, self.penalize = answers, max_staleness, max_age_s, penalize
        self.decode = decode
        self.scorer = scorer or RewardScorer()
        self.dropped: Counter = Counter()  # reason -> groups

    def accept(self, group: RolloutGroup, learner_version: int) -> bool:
        """True when `group` may be trained on; its rewards are then the learner's own."""
        if learner_version - group.version > self.max_staleness:
            self.dropped["too stale"] += 1
            return False
        if time.time() - group.created_at > self.max_age_s:
            self.dropped["too old"] += 1
            return False
        gold = self.answers.get(group.problem_id)
        if gold is None:
            self.dropped["unknown problem"] += 1
            self.penalize(group.sender, "unknown problem")
            return False
        texts = self.decode(group.completion_ids)
        rescored = self.scorer.score(texts, [gold] * group.size)
        if any(a is not None and b is not None and abs(a - b) > REWARD_TOLERANCE for a, b in zip(rescored, group.rewards)):
            self.dropped["reward mismatch"] += 1
            self.penalize(group.sender, "reward mismatch")
            return False
        group.rewards, group.completion_texts = rescored, texts
        return True

    def close(self) -> None:
        self.scorer.close()
