"""Who fetches a payload now, so that they share it out (swarm.fabric.weights.chunked_fetch): read from
membership records by each sampler (`sharers_for`), or for a delta named by the learner in its
signed announcement (`SharerView`), in the order of their chain, slow links last
(swarm.fabric.membership.link_judge)."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable

import swarm.fabric.weights.chunked_fetch as chunked_fetch  # (CHAIN_MAX read at each call: a benchmark sets it)
from swarm.fabric.membership.link_judge import LinkJudge
from swarm.fabric.membership.records import believable_holds
from swarm.fabric.weights.chunks import ChunkSpec

logger = logging.getLogger(__name__)

MEMBERS_WAIT_S = 5.0  # how long an announcement waits for the learner's membership lookup (then names no sharers)


def delta_base(ann) -> int:
    """The version an announced version's delta applies to: the newest of the learner's recent
    versions before it (a learner whose publishing fell behind skips versions), else the one before."""
    return max((v for v in ann.recent if v < ann.version), default=ann.version - 1)


def sharers_for(spec: ChunkSpec, members: Iterable, *, me: str, me_relays: bool, base: int | None = None) -> list[str]:
    """The peers that fetch `spec`'s payload now, by their records (sorted: every peer deals the
    stripes out alike): relaying samplers holding the delta's `base` as their newest (default: the
    version before), or holding none (a snapshot)."""
    found = set()
    for member in members:
        record = member.record
        holds = believable_holds(record, spec.version)  # records are data: a malformed or lying one is skipped
        if holds is None or record.role != "sampler" or record.relay is not True or record.peer_id == me or spec.version in holds:
            continue
        newest = max(holds) if holds else None
        if (newest == (spec.version - 1 if base is None else base)) if spec.kind == "delta" else newest is None:
            found.add(record.peer_id)
    if me_relays:
        found.add(me)
    return sorted(found)


class SharerView:
    """A learner's view of who fetches its newest delta: the members are looked up when it
    publishes a version (`publishing`, beside encoding the delta) and read when it announces it
    (`announced`), the same list at every announcement of that version, in the order of their
    chain: slow links last (swarm.fabric.membership.link_judge: one sampler at 20 Mbit/s among 8 at 100, sixth
    of a chain in peer id order, held the seven others' delta to 4.91 s, against 1.4 s)."""

    def __init__(self, fabric) -> None:
        self.fabric = fabric
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sharer-view")
        self._lookup: tuple[int, Future] | None = None
        self._named: tuple[int, list[str]] | None = None
        self._base: int | None = None  # what the delta being published applies to
        self.links = LinkJudge()  # the chains named and how fast their samplers fetched them

    def publishing(self, version: int, base: int | None = None) -> None:
        """`version` is being encoded, as a delta from `base` (default: the version before)."""
        self._lookup = (version, self._pool.submit(self.fabric.members))
        self._base = base

    def announced(self, version: int, chunks) -> list[str]:
        """The sharers to name in the announcement of `version` (chunks: what it announces; the
        announcement bounds the list); none without a delta, or when the lookup failed (samplers
        then look the members up themselves)."""
        if self._named is not None and self._named[0] == version:
            return self._named[1]
        delta = next((spec for spec in chunks if spec.kind == "delta" and spec.version == version), None)
        lookup = self._lookup
        if delta is None or lookup is None or lookup[0] != version:
            return []
        try:
            members = lookup[1].result(timeout=MEMBERS_WAIT_S)
        except Exception as exc:  # noqa: BLE001  a lookup hiccup: the samplers look for themselves
            logger.debug("member lookup for version %d failed: %s", version, exc)
            members = None
        named = []
        if members is not None:
            self.links.heard(members)
            named = self.links.order(sharers_for(delta, members, me=self.fabric.peer_id, me_relays=False, base=self._base),
                                     version)
            if len(named) <= chunked_fetch.CHAIN_MAX:  # (more deal the chunks out in stripes: their rates say less)
                self.links.named(version, named)
        self._named = (version, named)
        return named

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
