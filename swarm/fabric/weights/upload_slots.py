"""Upload slots: how many weight transfers a holder serves at once (a learner's upload budget, a
relay's share), who gets a freed slot, and the refusal a requester hears when none frees in time."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter

SHARE_UNITS = 1 << 20  # a slot's parts: shares are counted in whole units, so taking and releasing add up exactly


def _units(share: float) -> int:
    if not 0 < share <= 1:
        raise ValueError(f"a share of an upload slot is in (0, 1], not {share}")
    return max(1, round(share * SHARE_UNITS))


class HolderBusy(KeyError):
    """A holder refused a transfer because all its upload slots are taken: ask another (no blame)."""


class NotHeldYet(HolderBusy):
    """A holder does not hold the chunk asked for yet (it is on its way there): busy, but not for
    want of upload slots (a chain's probes tell the two apart: upstream_pace.WALK_AFTER_BUSY)."""


class UploadSlots:
    """How many weight transfers a peer serves at once: a learner's upload budget, a relay's share.
    None: no limit. A request over the limit waits a little for a slot (a chunk takes a fraction of
    a second: queueing costs less than a busy reply and a retry) and is then answered busy (the
    requester asks another holder) rather than queued behind transfers that may take minutes.

    A freed slot goes to the waiting requester that holds the fewest now, then to the one that was
    given the fewest since this peer was last idle (the earliest among equals): the learner hands
    out the stripes of a payload evenly, so no stripe owner falls behind the others and holds up
    everyone's last chunks; and a requester behind a slow link, whose chunks take five times as long
    to go out, holds no more of the slots than a fast one (by the count given alone, it was given a
    freed slot as often as the fast one, which then fetched at the slow one's pace: a chain peer that
    passed a slow upstream over and took from the same peer as it, upstream_pace).

    A transfer may take a `share` of a slot (a chunk smaller than a whole slot's: chunks.slot_share):
    the budget is bytes in flight, so a payload cut in small chunks keeps an uplink as busy as one
    cut in large chunks (with whole slots, 2 chunks of 256 KiB in flight left a learner's uplink
    half idle while its receivers' downlinks were shared with other senders)."""

    def __init__(self, limit: int | None) -> None:
        self.limit, self.refused = limit, 0
        self._used = 0  # SHARE_UNITS per slot in use
        self._cond = threading.Condition()
        self._tickets = itertools.count()
        self._waiting: dict[int, str] = {}  # ticket -> requester, while it waits
        self._given: Counter = Counter()  # requester -> slots given since the last idle moment
        self._held: Counter = Counter()  # requester -> SHARE_UNITS it holds now
        self._wakeups: set = set()  # (loop, future) of coroutines waiting in take_async

    @property
    def active(self) -> float:
        """Slots in use (a fraction while shares of one are)."""
        return self._used / SHARE_UNITS

    def _grant(self, ticket: int, units: int) -> bool:
        """Under the lock: give `ticket` `units` of a slot if they are free and it is the one to serve next."""
        if self.limit is not None and self._used + units > self.limit * SHARE_UNITS:
            return False
        if min(self._waiting, key=lambda t: (self._held[self._waiting[t]], self._given[self._waiting[t]], t)) != ticket:
            return False
        who = self._waiting.pop(ticket)
        self._used += units
        self._given[who] += 1
        self._held[who] += units
        return True

    def _give_up(self, ticket: int) -> None:
        """Under the lock: `ticket` stops waiting (refused or cancelled); the next in line may go."""
        if self._waiting.pop(ticket, None) is not None:
            self._wake()

    def _wake(self) -> None:
        self._cond.notify_all()
        for loop, future in list(self._wakeups):
            loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))

    def _line_up(self, who: str) -> int:
        """Under the lock: a ticket for requester `who`, waiting from now."""
        ticket = next(self._tickets)
        self._waiting[ticket] = who
        return ticket

    def take(self, wait_s: float = 0.0, who: str = "", share: float = 1.0) -> bool:
        """A slot (or `share` of one, release it alike) for requester `who`, waiting up to `wait_s` for it."""
        deadline = time.monotonic() + wait_s
        units = _units(share)
        with self._cond:
            ticket = self._line_up(who)
            while not self._grant(ticket, units):
                left = deadline - time.monotonic()
                if left <= 0:
                    self._give_up(ticket)
                    self.refused += 1
                    return False
                self._cond.wait(left)
            return True

    async def take_async(self, wait_s: float, who: str = "", share: float = 1.0) -> bool:
        """`take` on an event loop (it never blocks the loop; a caller cancelled while it waits has
        taken nothing)."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + wait_s
        units = _units(share)
        with self._cond:
            ticket = self._line_up(who)
        try:
            while True:
                future = loop.create_future()
                with self._cond:
                    if self._grant(ticket, units):
                        return True
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._give_up(ticket)
                        self.refused += 1
                        return False
                    self._wakeups.add((loop, future))
                try:
                    await asyncio.wait_for(future, min(left, 0.5))
                except asyncio.TimeoutError:
                    pass
                finally:
                    with self._cond:
                        self._wakeups.discard((loop, future))
        finally:
            with self._cond:
                self._give_up(ticket)  # a no-op once granted

    def release(self, share: float = 1.0, who: str = "") -> None:
        """Frees what `take` gave requester `who` with this `share`."""
        units = _units(share)
        with self._cond:
            self._used -= units
            self._held[who] -= units
            if self._held[who] <= 0:
                del self._held[who]
            if self._used <= 0 and not self._waiting:
                self._given.clear()  # idle: the next busy spell starts even
                self._held.clear()  # (and holds nothing, whoever a release named)
            self._wake()

    def busy_reply(self) -> dict:
        return {"ok": False, "busy": True, "reason": f"busy: serving {self.limit} transfers, its upload limit", "count": 0}
