"""Temporary bans of peers that keep sending bad data (malformed groups, forged rewards).

Every refusal that is the sender's fault (a malformed group, forged rewards, an unknown problem;
not a stale, duplicate or "busy" one) is a strike against the sending peer's id: over hivemind the
libp2p peer id the transport authenticates, over gRPC the key that signs the sender's requests
(grpc/common.py). Either way a new identity is free to make, so a ban slows a determined attacker
down rather than stopping it; what stops it is that every group is checked. `strikes` strikes within `window_s` seconds ban the peer for
`ban_s` seconds, during which everything it sends is refused unread. A ban expires on its own, so
a volunteer with a transient bug can come back.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque


class PeerBans:
    def __init__(self, strikes: int = 8, window_s: float = 120.0, ban_s: float = 600.0, clock=time.monotonic) -> None:
        if strikes < 1:
            raise ValueError("a ban needs at least one strike")
        self.strikes, self.window_s, self.ban_s = strikes, window_s, ban_s
        self._clock = clock
        self._recent: dict[str, deque] = defaultdict(deque)
        self._until: dict[str, float] = {}
        self.bans_issued = 0
        self._lock = threading.Lock()

    def strike(self, peer: str) -> bool:
        """Count one refusal against `peer`; True when this strike bans it."""
        now = self._clock()
        with self._lock:
            recent = self._recent[peer]
            recent.append(now)
            while recent and recent[0] < now - self.window_s:
                recent.popleft()
            if len(recent) >= self.strikes and self.ban_s > 0:
                recent.clear()
                self._until[peer] = now + self.ban_s
                self.bans_issued += 1
                return True
            return False

    def ban(self, peer: str) -> None:
        """Ban `peer` now, for an offence no honest peer commits (log-probs that do not match)."""
        with self._lock:
            self._recent.pop(peer, None)
            self._until[peer] = self._clock() + self.ban_s
            self.bans_issued += 1

    def remaining(self, peer: str) -> float:
        """Seconds left on `peer`'s ban (0 when it is not banned)."""
        with self._lock:
            until = self._until.get(peer)
            if until is None:
                return 0.0
            left = until - self._clock()
            if left <= 0:
                del self._until[peer]
                return 0.0
            return left

    def banned(self) -> list[str]:
        return [p for p in list(self._until) if self.remaining(p) > 0]
