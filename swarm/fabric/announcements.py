"""What learners announce: the newest version of a run, signed under a learner key, read back by
samplers (over hivemind from the DHT; over gRPC from the registry, grpc_peer.py) and trusted only
under the run's owner keys or a key they certified (swarm.fabric.authority)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable

from swarm.fabric.chunks import ChunkSpec
from swarm.fabric.records import RunSampling, VersionAnnouncement, versions_key

logger = logging.getLogger(__name__)


@dataclass
class Announced:
    version: int
    hash: str
    peer_id: str
    sampling: RunSampling = RunSampling()
    recent: dict[int, str] = field(default_factory=dict)  # signed hashes of the versions just before it
    chunks: dict[str, ChunkSpec] = field(default_factory=dict)  # kind -> how its payloads are chunked
    peers: tuple[str, ...] = ()  # every authorised learner announcing this version and hash (peer ids)
    sharers: tuple[str, ...] = ()  # who fetches its delta in chunks, by the learner (VersionAnnouncement.sharers)



def store_announcement(dht, public_key_subkey: bytes, announcement: VersionAnnouncement, *, expiry_s: float = 60.0) -> bool:
    """Store a learner's announcement in the DHT under its key (signed there by the DHT's validator)."""
    return bool(dht.store(versions_key(announcement.run_id), subkey=public_key_subkey, value=announcement.dict(),
                          expiration_time=announcement.time + expiry_s))


def latest_announced(dht, run_id: str, learner_keys: Iterable[bytes]) -> Announced | None:
    """The newest version announced by the run's owner keys `learner_keys` or a learner they certified;
    everything else is ignored."""
    found = dht.get(versions_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return None
    return newest_authorised(((subkey, item.value) for subkey, item in found.value.items()), learner_keys, run_id)


def newest_authorised(items: Iterable[tuple[bytes, dict]], learner_keys: Iterable[bytes], run_id: str) -> Announced | None:
    """Of (owner key, announcement) pairs, the newest well-formed one of `run_id` whose key is one of
    `learner_keys` (the run's owner keys) or carries their certificate for it (swarm.fabric.authority).
    Its `peers` are every authorised learner announcing that version with that hash: where to send
    rollouts when several learners train the run."""
    from swarm.fabric.authority import authorises

    allowed = frozenset(learner_keys)
    valid = []
    for owner, value in items:
        try:
            ann = VersionAnnouncement.parse_obj(value)
        except Exception:  # noqa: BLE001
            continue
        if ann.run_id != run_id:
            logger.debug("ignoring an announcement of run %r", ann.run_id)
            continue
        if owner not in allowed and not (ann.certificate and authorises(ann.certificate, run_id, allowed, owner)):
            logger.debug("ignoring a version announcement by an unauthorised key")
            continue
        valid.append((owner, ann))
    if not valid:
        return None
    # the newest version; among its announcers the owner's first, then the earliest announcement
    best = max(valid, key=lambda item: (item[1].version, item[0] in allowed, -item[1].time))[1]
    peers = tuple(sorted({ann.peer_id for _, ann in valid if ann.version == best.version and ann.hash == best.hash}))
    return Announced(best.version, best.hash, best.peer_id, best.sampling, best.recent_hashes, best.chunk_specs, peers,
                     tuple(best.sharers))
