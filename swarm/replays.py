"""The content of the groups a learner has accepted, so that one group cannot be trained on twice.

The inbox delivers each group id at most once, but an id is the sender's to choose: one valid
group re-sent under fresh ids was trained on 12 times in 3 steps (issue 45). So a group is also
known by what it holds: a hash of its prompt tokens and of its completions' tokens (as a multiset:
reordering the completions makes no new group). Claimed log-probs, rewards, versions and times are
left out, so changing them makes no new group either. Identical completions inside one group are
normal at low temperature; a whole group identical to one already accepted is not.

Memory is bounded: a hash is kept for the run's staleness window (a group sampled at version v is
usable until the learner reaches v + max_staleness, so a copy of it is refused at least as long),
and never more than `max_entries` hashes (the oldest go first). Only accepted groups are
remembered: a refused group cannot make an honest one look like a copy.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from swarm.rollouts import RolloutGroup

MAX_REMEMBERED = 1_000_000  # 32-byte digests and a version each: well under 200 MB even at this cap


def content_hash(group: RolloutGroup) -> bytes:
    """sha256 over the prompt's tokens and the sorted completions' tokens."""
    digest = hashlib.sha256()
    digest.update(b"prompt:" + ",".join(map(str, group.prompt_ids)).encode())
    for completion in sorted(",".join(map(str, c)) for c in group.completion_ids):
        digest.update(b"|completion:" + completion.encode())
    return digest.digest()


class SeenContent:
    """Hashes of accepted groups, each with the learner version at which it was accepted.

    window: versions a hash is kept for (the run's max_staleness). max_entries: the most kept."""

    def __init__(self, *, window: int, max_entries: int = MAX_REMEMBERED) -> None:
        if window < 0 or max_entries < 1:
            raise ValueError(f"a content memory needs window >= 0 and max_entries >= 1, got {window} and {max_entries}")
        self.window, self.max_entries = window, max_entries
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # hash -> learner version when accepted, oldest first

    def __len__(self) -> int:
        return len(self._seen)

    def seen(self, group: RolloutGroup, learner_version: int) -> bool:
        """Whether a group with `group`'s content was accepted within the window."""
        self._forget_before(learner_version - self.window)
        return content_hash(group) in self._seen

    def remember(self, group: RolloutGroup, learner_version: int) -> None:
        key = content_hash(group)
        self._seen[key] = learner_version
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)

    def _forget_before(self, version: int) -> None:
        # accepted in version order (the learner's version only grows), so the oldest come first
        while self._seen and next(iter(self._seen.values())) < version:
            self._seen.popitem(last=False)
