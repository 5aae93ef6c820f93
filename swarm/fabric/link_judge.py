"""Which samplers' links are slow, judged by a learner from the fetches their heartbeats report, so
that it names each delta's chain with the slow links last (swarm.fabric.chunked_fetch.SharerView).

Along a chain every sampler fetches at about the pace of the slowest hop before it, so a sampler
behind a slow one fetches as slowly and its rate says nothing of its own link. A rate says
something only where it drops: below DROP_RATIO of the slowest rate before it in the chain the
learner named (for the chain's head, of the median of the other samplers' best rates lately: one
sampler claiming a huge rate cannot make every head look slow). A
sampler with such a drop in the last MEMORY chains is slow: slow samplers go last, the fastest of
them first, and hold up only each other; the others come first, in an order drawn anew for each
version (a slow head shows no drop, as everyone after it is as slow; behind another head it does).

Not found: a slow uplink behind a fast downlink. The drop then shows at the sampler after it, which
goes last instead (where it holds nobody up), and the one after it drops in its turn.
"""

from __future__ import annotations

import hashlib
import statistics
from collections import OrderedDict
from typing import Iterable

RATE_MIN_BYTES = 1 << 20  # a smaller fetch says little of a link: its start costs more than its bytes
MEMORY = 8  # versions whose chains and fetch rates are kept: a sampler judged slow stays so this long
# a rate below this share of the slowest before it is a drop: along a chain of equal links the rates
# agree within about 20% (8 samplers at 100 Mbit/s: a 9.7 MB delta in 1.0-1.25 s each)
DROP_RATIO = 0.6
PEERS_KEPT = 1024  # samplers whose rates are kept (those heard of least lately are dropped)


def link_rate(record) -> float | None:
    """Bytes per second of a member's last fetch, as its record reports it; None when that says
    little of its link (no fetch, a small one, or a peer too old to report its transfer time)."""
    if record.role != "sampler" or record.fetch_bytes < RATE_MIN_BYTES or record.fetch_transfer_s <= 0:
        return None
    return record.fetch_bytes / record.fetch_transfer_s


class LinkJudge:
    """The chains a learner named and the rates its samplers fetched them at: who is slow."""

    def __init__(self) -> None:
        self._chains: OrderedDict[int, list[str]] = OrderedDict()  # version -> the chain named for its delta
        self._rates: OrderedDict[str, dict[int, float]] = OrderedDict()  # sampler -> {version fetched: rate}

    def heard(self, members) -> None:
        """Keeps each sampler's last fetch rate from its record (a record repeats its last fetch)."""
        for member in members:
            record = member.record
            rate = link_rate(record)
            if rate is None:
                continue
            rates = self._rates.setdefault(record.peer_id, {})
            self._rates.move_to_end(record.peer_id)
            rates[record.fetch_version] = rate
            for old in sorted(rates)[:-MEMORY]:
                del rates[old]
        while len(self._rates) > PEERS_KEPT:
            self._rates.popitem(last=False)

    def named(self, version: int, chain: list[str]) -> None:
        """The chain named for `version`'s delta (its samplers' next records report how it went)."""
        self._chains[version] = list(chain)
        while len(self._chains) > MEMORY:
            self._chains.popitem(last=False)

    def slow(self) -> dict[str, float]:
        """The samplers judged slow: the rate of each one's latest drop (bytes per second)."""
        best = {peer: max(rates.values()) for peer, rates in self._rates.items() if rates}
        found: dict[str, float] = {}
        for version, chain in self._chains.items():  # oldest first: a later drop is the one kept
            floor = None  # the slowest rate before this sampler in the chain
            for peer in chain:
                rate = self._rates.get(peer, {}).get(version)
                if rate is None:
                    continue
                others = [b for p, b in best.items() if p != peer]
                ref = floor if floor is not None else statistics.median(others) if others else None
                if ref is not None and rate < DROP_RATIO * ref:
                    found[peer] = rate
                floor = rate if floor is None else min(floor, rate)
        return found

    def order(self, sharers: Iterable[str], version: int) -> list[str]:
        """`sharers` in the order of `version`'s chain: samplers not judged slow first, then the slow
        ones, the fastest of them first. Sorted by peer id while no sharer's rate is known (a
        payload too small to judge links by); else in an order drawn from a hash of version and peer."""
        sharers = list(dict.fromkeys(sharers))
        slow = self.slow()
        known = any(peer in self._rates for peer in sharers)

        def key(peer: str) -> tuple:
            draw = hashlib.sha256(f"{version}:{peer}".encode()).hexdigest() if known else ""
            return (peer in slow, -slow.get(peer, 0.0), draw, peer)
        return sorted(sharers, key=key)
