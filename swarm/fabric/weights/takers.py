"""Which relaying peer each chunk of a complete payload went to (`Takers`, kept by chunks.ChunkBook):
a holder sends each chunk once per fan-out, and a later requester of it to the peer that took it
(`Redirected`, as the requester's client raises it)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

# how long a whole holder sends a chunk's later requesters to the relaying peer it sent the chunk to
# (a fan-out's wave: the requests for one chunk come within seconds of each other; a later fetch
# would pay a round trip per chunk to a peer that may have moved on)
REDIRECT_S = 30.0
MAX_TAKEN_PAYLOADS = 4  # payloads whose takers are remembered (a version's delta and snapshot, the last two)
# the share of a payload's chunks one requester is sent to one taker for: a peer that took every
# chunk (and serves them slowly, or not at all) holds no requester's whole payload, whatever that
# requester's own judging does (chunked_fetch.SLOW_RATIO); past it, the holder sends the chunk itself
REDIRECT_SHARE = 0.5
MIN_REDIRECTS = 2  # ... but at least this many chunks (a small payload's few chunks)
MAX_REQUESTERS_KEPT = 1024  # requesters whose redirects are counted, per payload (least recent dropped)


class Redirected(KeyError):
    """A holder of the whole payload sent this chunk to `target` already (a relaying peer that holds
    it or is receiving it): ask `target` for it, and this holder again with `force` if that fails."""

    def __init__(self, holder, target: str) -> None:
        super().__init__(f"holder {holder} sent this chunk to {target} already")
        self.target = target


class Takers:
    """Which relaying peer each chunk of the complete payloads held here went to last, and when:
    a holder that sends a chunk to every peer asking for it uploads as many copies as there are
    peers whose plans missed it; sent to the first taker instead, they cost it one."""

    def __init__(self) -> None:
        self._taken: OrderedDict[tuple[str, int, str], dict[int, tuple[str, float]]] = OrderedDict()
        # per payload: requester -> how many of its requests went to each taker (REDIRECT_SHARE)
        self._sent: dict[tuple[str, int, str], OrderedDict[str, dict[str, int]]] = {}
        self._lock = threading.Lock()
        self.redirected = 0  # requests sent to an earlier taker
        self.capped = 0  # requests sent here, not to a taker, as the requester had its share of that taker

    def taken(self, key: tuple[str, int, str]) -> int:
        """How many chunks of payload `key` went to a relaying peer (as far as remembered)."""
        with self._lock:
            return len(self._taken.get(key, ()))

    def claim(self, key: tuple[str, int, str], index: int, taker: str, *, relays: bool, force: bool,
              count: int = 0) -> str | None:
        """The peer to send `taker` to for chunk `index` of payload `key` (kind, version, root), or
        None: send it here, and `taker` (if it relays) becomes the chunk's taker, in the same step:
        two requests for the same chunk never both pass. A requester is sent to one taker for at
        most REDIRECT_SHARE of the payload's `count` chunks."""
        with self._lock:
            found = self._taken.get(key, {}).get(index)
            now = time.monotonic()
            if not force and found is not None and found[0] != taker and now - found[1] <= REDIRECT_S:
                requesters = self._sent.setdefault(key, OrderedDict())
                sent = requesters.get(taker, {})
                if sent.get(found[0], 0) < max(MIN_REDIRECTS, int(count * REDIRECT_SHARE)):
                    requesters[taker] = sent
                    requesters.move_to_end(taker)
                    sent[found[0]] = sent.get(found[0], 0) + 1
                    while len(requesters) > MAX_REQUESTERS_KEPT:
                        requesters.popitem(last=False)
                    self.redirected += 1
                    return found[0]
                self.capped += 1
            if relays and taker:
                self._taken.setdefault(key, {})[index] = (taker, now)
                self._taken.move_to_end(key)
                while len(self._taken) > MAX_TAKEN_PAYLOADS:
                    self._sent.pop(self._taken.popitem(last=False)[0], None)
            return None
