"""The swarm's records in hivemind's DHT, under a run id: membership records and version
announcements.

Each peer owns one subkey of the dictionary keys `{run_id}_members` and `{run_id}_versions`: its
subkey embeds its RSA public key (`[owner:...]`), the value is signed with the matching private
key, so hivemind's RSASignatureValidator refuses any write to it by another peer; SchemaValidator
refuses values that do not match MemberRecord / VersionAnnouncement (strict types: no silent
conversions). Records carry an expiration a few heartbeats ahead, so a peer that vanishes
disappears from listings on its own.
"""



from typing import Dict, Iterable, Optional

from hivemind.dht.schema import BytesWithPublicKey
from hivemind.utils import get_dht_time
from pydantic.v1 import BaseModel

from swarm.config import SwarmSettings, default_of
from swarm.fabric.membership.records import EXPIRY_HEARTBEATS, Heartbeat, Member, MemberRecord, members_key
from swarm.fabric.signing import is_canonical_owner
from swarm.fabric.weights.announcements import Announced, VersionAnnouncement, newest_authorised, versions_key


def make_schema(run_id: str):
    """A schema class per run: SchemaValidator identifies fields by the hash of `{prefix}_{name}`."""

    class SwarmSchema(BaseModel):
        members: Dict[BytesWithPublicKey, Optional[MemberRecord]]
        versions: Dict[BytesWithPublicKey, Optional[VersionAnnouncement]]

    return SwarmSchema


class MembershipPublisher:
    """Writes this peer's membership record; call `heartbeat()` every `heartbeat_s` seconds."""

    def __init__(self, dht, run_id: str, public_key_subkey: bytes, *, heartbeat_s: float = default_of(SwarmSettings, "heartbeat_s"),
                 expiry_heartbeats: float = EXPIRY_HEARTBEATS):
        self.dht = dht
        self.key = members_key(run_id)
        self.subkey = public_key_subkey
        self.heartbeat_s = heartbeat_s
        self.expiry_s = heartbeat_s * expiry_heartbeats

    def heartbeat(self, beat: Heartbeat) -> bool:
        now = get_dht_time()
        value = beat.record(self.dht.peer_id.to_base58(), now).dict()
        return bool(self.dht.store(self.key, subkey=self.subkey, value=value, expiration_time=now + self.expiry_s))


def list_members(dht, run_id: str) -> "list[Member]":
    """Current, unexpired members of the run (records that fail the schema are never stored)."""
    found = dht.get(members_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    members = []
    for subkey, item in found.value.items():
        if not is_canonical_owner(subkey):  # one key, one member: another spelling of a key's text is no second member
            continue
        try:
            record = MemberRecord.parse_obj(item.value)
        except Exception:  # noqa: BLE001  a record another version wrote: skip it
            continue
        members.append(Member(record=record, expires_at=item.expiration_time, owner=subkey))
    return sorted(members, key=lambda m: (m.record.role, m.record.peer_id))


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
