"""The swarm's records in hivemind's DHT, under a run id: membership records, version
announcements and the run owner's revocation list.

Every record is a subkey of a DHT dictionary; the subkey is a signing key's one canonical
`[owner:...]` text (swarm.fabric.signing.canonical_owner), the value is signed with the
matching private key, so hivemind's RSASignatureValidator refuses any write to it by another peer,
and one key owns at most one record per dictionary (record_rules.OwnerRules). Records carry an
expiration a few heartbeats ahead, so a peer that vanishes disappears from listings on its own.

Where they live, so that no flood makes one read unbounded and the run's own learners stay findable:
- `{run_id}_members_{page}`: every peer's membership record, in one of MEMBER_PAGES pages chosen by
  its key (SchemaValidator checks the value against MemberRecord; OwnerRules the page). A listing
  reads the pages side by side and keeps at most MAX_LISTED_PER_PAGE of each.
- `{run_id}_learners_{fingerprint of the owner key}`: a learner's record once more, in the directory
  of the run owner that certified it (or its own, as the owner): only the owner's key and keys it
  certified may write there, so the run's learners are found from the owner keys a peer already
  trusts, whatever the open pages hold.
- `{run_id}_versions_{fingerprint}`: version announcements, in the same owner's directory.
- `{run_id}_revoked_{fingerprint}`: the owner's revocation list (swarm.fabric.membership.authority).
"""

from __future__ import annotations

import random
from functools import partial
from typing import Dict, Iterable, Optional

from hivemind.dht.schema import BytesWithPublicKey
from hivemind.utils import get_dht_time
from pydantic.v1 import BaseModel, constr, create_model

from swarm.config import SwarmSettings, default_of
from swarm.fabric.membership.authority import (
    MAX_CERTIFICATE_DAYS,
    MAX_REVOCATION_CHARS,
    CertificateError,
    Revocations,
    authorises,
    key_fingerprint,
    parse,
    parse_revocations,
)
from swarm.fabric.membership.records import (
    EXPIRY_HEARTBEATS,
    MEMBER_PAGES,
    Heartbeat,
    Member,
    MemberRecord,
    member_page,
    member_page_key,
)
from swarm.fabric.signing import canonical_owner
from swarm.fabric.weights.announcements import Announced, VersionAnnouncement, newest_authorised

MAX_LISTED_PER_PAGE = 256  # records kept from one page: a flooded page crowds out no other
MAX_OWNER_KEYS_READ = 16  # owner keys whose directories one lookup reads
READ_TIMEOUT_S = 20.0  # one listing's DHT reads, all pages together


def directory_key(run_id: str, kind: str, owner: bytes) -> str:
    """The run owner `owner`'s own dictionary of `kind` ("learners", "versions" or "revoked")."""
    return f"{run_id}_{kind}_{key_fingerprint(owner)}"


DIRECTORIES = ("learners", "versions", "revoked")


class RevocationRecord(BaseModel):
    """The run owner's revocation list, as authority.revoke signs it."""

    token: constr(min_length=1, max_length=MAX_REVOCATION_CHARS, strict=True)


def make_schema(run_id: str):
    """A schema class per run: SchemaValidator identifies fields by the hash of `{prefix}_{name}`
    (the owners' directories have no fixed names: record_rules.OwnerRules checks those)."""
    fields = {f"members_{page}": (Dict[BytesWithPublicKey, Optional[MemberRecord]], None) for page in range(MEMBER_PAGES)}
    return create_model("SwarmSchema", **fields)


def certifying_owner(subkey: bytes, certificate: str) -> bytes:
    """Whose directory a learner with `certificate` ("" for the run owner itself) writes in."""
    return parse(certificate).owner if certificate else canonical_owner(subkey)


class MembershipPublisher:
    """Writes this peer's membership record; call `heartbeat()` every `heartbeat_s` seconds. A
    learner's record goes in its run owner's learner directory as well."""

    def __init__(self, dht, run_id: str, public_key_subkey: bytes, *, heartbeat_s: float = default_of(SwarmSettings, "heartbeat_s"),
                 expiry_heartbeats: float = EXPIRY_HEARTBEATS):
        self.dht, self.run_id = dht, run_id
        self.subkey = canonical_owner(public_key_subkey)
        self.key = member_page_key(run_id, member_page(self.subkey))
        self.heartbeat_s = heartbeat_s
        self.expiry_s = heartbeat_s * expiry_heartbeats

    def heartbeat(self, beat: Heartbeat) -> bool:
        now = get_dht_time()
        value = beat.record(self.dht.peer_id.to_base58(), now).dict()
        stored = bool(self.dht.store(self.key, subkey=self.subkey, value=value, expiration_time=now + self.expiry_s))
        if beat.role == "learner":
            directory = directory_key(self.run_id, "learners", certifying_owner(self.subkey, beat.certificate))
            stored = bool(self.dht.store(directory, subkey=self.subkey, value=value, expiration_time=now + self.expiry_s)) and stored
        return stored


async def _read_dictionaries(_dht, node, keys: list, per_key: int) -> dict:
    """In the DHT process: the entries (subkey, value, expiration) of the dictionaries at `keys`,
    at most `per_key` of each, so that what crosses back is bounded. Of a fuller one a random
    `per_key` are kept: a flood can choose its records' expiry and every field, so no order of
    them would keep honest records in; drawn at random, each has a fair chance at every read."""
    found = await node.get_many(keys, sufficient_expiration_time=float("inf"))  # what DHT.get(latest=True) asks
    out = {}
    for key in keys:
        item = found.get(key)
        entries = []
        if item is not None and hasattr(item.value, "items"):
            for subkey, entry in item.value.items():
                if isinstance(subkey, bytes):
                    entries.append((subkey, entry.value, entry.expiration_time))
        out[key] = entries if len(entries) <= per_key else random.sample(entries, per_key)
    return out


def read_dictionaries(dht, keys: list[str], per_key: int) -> dict[str, list]:
    """{key: [(subkey, value, expiration), ...]} for `keys`, read side by side, bounded per key."""
    if not keys:
        return {}
    return dht.run_coroutine(partial(_read_dictionaries, keys=list(keys), per_key=per_key), return_future=True) \
        .result(timeout=READ_TIMEOUT_S)


def _members(entries: Iterable) -> list[Member]:
    members = []
    for subkey, value, expires_at in entries:
        try:
            record = MemberRecord.parse_obj(value)
        except Exception:  # noqa: BLE001  a record another version wrote: skip it
            continue
        if record.leaving:  # gone, though its record has not expired yet
            continue
        members.append(Member(record=record, expires_at=expires_at, owner=subkey))
    return members


def list_members(dht, run_id: str) -> list[Member]:
    """Current, unexpired members of the run, from every page: at most MAX_LISTED_PER_PAGE a page."""
    found = read_dictionaries(dht, [member_page_key(run_id, page) for page in range(MEMBER_PAGES)], MAX_LISTED_PER_PAGE)
    members = [m for entries in found.values() for m in _members(entries)]
    return sorted(members, key=lambda m: (m.record.role, m.record.peer_id))


def _owners(owner_keys: Iterable[bytes]) -> list[bytes]:
    keys = []
    for key in owner_keys:
        try:
            keys.append(canonical_owner(key))
        except ValueError:
            continue
    return list(dict.fromkeys(keys))[:MAX_OWNER_KEYS_READ]


def _newest_revocations(entries: Iterable, run_id: str, owner: bytes) -> Revocations | None:
    newest = None
    for subkey, value, _ in entries:
        if subkey != owner or not isinstance(value, dict):
            continue
        try:
            revocations = parse_revocations(value.get("token"))
        except (CertificateError, TypeError):
            continue
        if revocations.owner == owner and revocations.run_id == run_id and (newest is None or revocations.issued > newest.issued):
            newest = revocations
    return newest


def _revoked(found: dict, run_id: str, owners: list[bytes]) -> frozenset[str]:
    """The fingerprints the owners' newest revocation lists in `found` (read_dictionaries) name."""
    revoked = set()
    for owner in owners:
        newest = _newest_revocations(found.get(directory_key(run_id, "revoked", owner), ()), run_id, owner)
        revoked |= set(newest.revoked) if newest is not None else set()
    return frozenset(revoked)


def _read_with_revocations(dht, run_id: str, kind: str, owners: list[bytes]) -> tuple[list, frozenset[str]]:
    """The entries of the owners' `kind` directories, and the keys they revoked, in one read."""
    keys = [directory_key(run_id, kind, owner) for owner in owners]
    found = read_dictionaries(dht, keys + [directory_key(run_id, "revoked", owner) for owner in owners], MAX_LISTED_PER_PAGE)
    return [e for key in keys for e in found.get(key, ())], _revoked(found, run_id, owners)


def read_revoked(dht, run_id: str, owner_keys: Iterable[bytes]) -> frozenset[str]:
    """The fingerprints of the learner keys the run owners `owner_keys` revoked."""
    owners = _owners(owner_keys)
    return _revoked(read_dictionaries(dht, [directory_key(run_id, "revoked", o) for o in owners], 4), run_id, owners)


def store_revocations(dht, owner_subkey: bytes, revocations: Revocations) -> bool:
    """Store the owner's revocation list under its key (the DHT's validator signs it with the
    owner's key, which `dht` must have been started with). It lasts as long as a certificate can."""
    now = get_dht_time()
    return bool(dht.store(directory_key(revocations.run_id, "revoked", owner_subkey), subkey=canonical_owner(owner_subkey),
                          value=RevocationRecord(token=revocations.token).dict(),
                          expiration_time=now + MAX_CERTIFICATE_DAYS * 86400.0))


def authorised_learners(dht, run_id: str, owner_keys: Iterable[bytes]) -> list[Member]:
    """The learners the run owners `owner_keys` authorised (themselves, or certified, unexpired and
    not revoked), from the owners' learner directories: the open member pages are not read."""
    owners = _owners(owner_keys)
    entries, revoked = _read_with_revocations(dht, run_id, "learners", owners)
    allowed = frozenset(owners)
    learners = []
    for member in _members(entries):
        if member.record.role != "learner":
            continue
        if member.owner in allowed or authorises(member.record.certificate, run_id, allowed, member.owner, revoked=revoked):
            learners.append(member)
    return sorted(learners, key=lambda m: m.record.peer_id)


def store_announcement(dht, public_key_subkey: bytes, announcement: VersionAnnouncement, *, expiry_s: float = 60.0) -> bool:
    """Store a learner's announcement in its run owner's version directory, under its own key (signed
    there by the DHT's validator)."""
    subkey = canonical_owner(public_key_subkey)
    directory = directory_key(announcement.run_id, "versions", certifying_owner(subkey, announcement.certificate))
    return bool(dht.store(directory, subkey=subkey, value=announcement.dict(), expiration_time=announcement.time + expiry_s))


def latest_announced(dht, run_id: str, learner_keys: Iterable[bytes]) -> Announced | None:
    """The newest version announced by the run's owner keys `learner_keys` or a learner they
    certified (unexpired, not revoked); everything else is ignored, and only the owners' own
    directories are read."""
    owners = _owners(learner_keys)
    entries, revoked = _read_with_revocations(dht, run_id, "versions", owners)
    items = [(subkey, value) for subkey, value, _ in entries if subkey in owners or key_fingerprint(subkey) not in revoked]
    return newest_authorised(items, owners, run_id)
