"""Which samplers' links are slow, judged by a learner from the fetches their heartbeats report, so
that it names each delta's chain with the slow links last (swarm.fabric.weights.sharer_view.SharerView).

Along a chain every sampler fetches at about the pace of the slowest hop before it, so a sampler
behind a slow one fetches as slowly and its rate says nothing of its own link. A rate says
something only where it drops: below DROP_RATIO of the slowest rate before it in the chain the
learner named (for the chain's head, of the median of the other samplers' best rates lately: one
sampler claiming a huge rate cannot make every head look slow).

A drop is the fault of one of two links: the sampler's download, or the upload of the sampler named
before it (its feeder). A sampler that fetched at full pace lately (its best rate at least
DROP_RATIO of the others' median best) has a download that keeps up: its drop is its feeder's,
whose upload is judged slow. Otherwise the drop is its own: its download is judged slow. So a slow
uplink is found once a sampler that has fetched at full pace drops behind it; a drop before that is
blamed on the sampler that had it, until that one fetches at full pace elsewhere.

Order: the samplers judged slow by neither come first, in an order drawn anew for each version;
then the slow downloads, the fastest first, holding up only each other; then the slow uplinks, with
nobody behind them (they fetch at the pace of the slow downloads before them, if any; between the
two, a sampler wrongly judged slow behind a slow uplink would sit behind it in every chain after,
never to show that its download keeps up). A judgment lasts while its drops are among the last
MEMORY chains: a slow uplink, last, is tried again after that.
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
        """The samplers whose downloads are judged slow: the rate of each one's latest drop (bytes
        per second)."""
        return self._judge()[0]

    def slow_uplinks(self) -> set[str]:
        """The samplers whose uploads are judged slow: a sampler whose download keeps up elsewhere
        dropped behind each of them."""
        return self._judge()[1]

    def _judge(self) -> tuple[dict[str, float], set[str]]:
        best = {peer: max(rates.values()) for peer, rates in self._rates.items() if rates}
        typicals: dict[str, float | None] = {}  # per sampler: the median of the others' best rates

        def typical_for(peer: str) -> float | None:
            if peer not in typicals:
                others = [b for p, b in best.items() if p != peer]
                typicals[peer] = statistics.median(others) if others else None
            return typicals[peer]

        slow_down: dict[str, float] = {}
        slow_up: set[str] = set()
        for version, chain in self._chains.items():  # oldest first: a later drop is the one kept
            floor = None  # the slowest rate before this sampler in the chain
            for place, peer in enumerate(chain):
                rate = self._rates.get(peer, {}).get(version)
                if rate is None:
                    continue
                typical = typical_for(peer)
                ref = floor if floor is not None else typical
                if ref is not None and rate < DROP_RATIO * ref:
                    keeps_up = typical is not None and best[peer] >= DROP_RATIO * typical
                    if keeps_up and place > 0:
                        slow_up.add(chain[place - 1])
                    elif not keeps_up:
                        slow_down[peer] = rate
                    # (a head that keeps up elsewhere dropped for the learner's sake: nobody is judged)
                floor = rate if floor is None else min(floor, rate)
        return slow_down, slow_up

    def order(self, sharers: Iterable[str], version: int) -> list[str]:
        """`sharers` in the order of `version`'s chain: samplers judged slow by neither link first,
        then slow downloads, the fastest of them first, then slow uplinks. Sorted by peer id while no
        sharer's rate is known (a payload too small to judge links by); else in an order drawn from a
        hash of version and peer."""
        sharers = list(dict.fromkeys(sharers))
        slow_down, slow_up = self._judge()
        known = any(peer in self._rates for peer in sharers)

        def key(peer: str) -> tuple:
            draw = hashlib.sha256(f"{version}:{peer}".encode()).hexdigest() if known else ""
            tier = 2 if peer in slow_up else 1 if peer in slow_down else 0
            return (tier, -slow_down.get(peer, 0.0), draw, peer)
        return sorted(sharers, key=key)
