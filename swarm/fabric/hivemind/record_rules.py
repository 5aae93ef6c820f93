"""Where a signed record may be stored: one record per owner, in its own place.

hivemind's RSASignatureValidator accepts any subkey that *contains* `[owner:KEY]` once the value is
signed by KEY, so one key could write thousands of subkeys (`a[owner:KEY]`, `b[owner:KEY]`, or KEY
with a comment appended), each listed as a separate owner. `OwnerRules` runs after the signature
check (a lower priority) on every node of the run and refuses, for any record whose subkey names
an owner key:
- a subkey other than the key's one canonical text (signing.canonical_owner);
- a membership record in another page than its key's (records.member_page);
- a record in an owner's directory (records.directory_key) by another key, unless the run owner
  named by the directory certified it (a learner's record or announcement carrying an unexpired
  certificate for this run) -- and a record in the revocation directory by anyone but its owner;
- a value in an owner's directory that does not match its schema (MemberRecord,
  VersionAnnouncement, RevocationRecord; strict: no conversions, as SchemaValidator does);
- an owner-signed record at any other key of no known kind (its key is a hash: nothing else could
  tell it from the directory of someone it does not belong to).
Records without an owner key in their subkey are left to the other validators.
"""

from __future__ import annotations

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from swarm.config.learner_keys import OWNER_PREFIX
from swarm.fabric.hivemind.records import RevocationRecord, directory_key
from swarm.fabric.membership.authority import MAX_CERTIFICATE_DAYS, CertificateError, parse
from swarm.fabric.membership.records import MEMBER_PAGES, MemberRecord, member_page, member_page_key
from swarm.fabric.signing import canonical_owner
from swarm.fabric.weights.announcements import VersionAnnouncement

SCHEMAS = {"learners": MemberRecord, "versions": VersionAnnouncement, "revoked": RevocationRecord}
# how far ahead a record may expire: a heartbeat's record or an announcement lives a few heartbeats,
# so a flood cannot outlast honest records by far (an hour, as the gRPC registry allows); a
# revocation list lives as long as a certificate can
MAX_AHEAD_S = {"members": 3600.0, "learners": 3600.0, "versions": 3600.0, "revoked": MAX_CERTIFICATE_DAYS * 86400.0 + 3600.0}


def key_id(key: str) -> bytes:
    """The DHT's id of `key`, as validators see it in `DHTRecord.key`."""
    return DHTID.generate(source=key).to_bytes()


def _strictly(schema, value) -> bool:
    """Whether `value` is a `schema` dict that needs no conversion (SchemaValidator's rule)."""
    if not isinstance(value, dict):
        return False
    try:
        return schema.parse_obj(value).dict() == value
    except Exception:  # noqa: BLE001  pydantic's errors, or a value of another shape
        return False


class OwnerRules(RecordValidatorBase):
    """The rules in this module's docstring, for run `run_id`."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.pages = {key_id(member_page_key(run_id, page)): page for page in range(MEMBER_PAGES)}

    def validate(self, record: DHTRecord) -> bool:
        if record.subkey in DHTProtocol.RESERVED_SUBKEYS or OWNER_PREFIX not in record.subkey:
            return True  # no owner key in it: not protected, the other validators decide
        try:
            subkey = DHTProtocol.serializer.loads(record.subkey)
            if not isinstance(subkey, bytes) or subkey != canonical_owner(subkey):
                return False  # a second text of a key: one owner, one record
        except Exception:  # noqa: BLE001  neither msgpack bytes nor a key that parses
            return False
        if record.key in self.pages:
            return self.pages[record.key] == member_page(subkey) and self._soon(record, "members")
        try:
            value = DHTProtocol.serializer.loads(record.value)
        except Exception:  # noqa: BLE001
            return False
        for kind, schema in SCHEMAS.items():
            if record.key == key_id(directory_key(self.run_id, kind, subkey)):
                return _strictly(schema, value) and self._soon(record, kind)  # the owner's own directory
        certificate = value.get("certificate") if isinstance(value, dict) else None
        if not certificate or not isinstance(certificate, str):
            return False
        try:
            cert = parse(certificate)
        except CertificateError:
            return False
        if cert.learner != subkey or cert.run_id != self.run_id or cert.problem():
            return False
        for kind in ("learners", "versions"):
            if record.key == key_id(directory_key(self.run_id, kind, cert.owner)):
                return _strictly(SCHEMAS[kind], value) and self._soon(record, kind)
        return False

    @staticmethod
    def _soon(record: DHTRecord, kind: str) -> bool:
        return record.expiration_time <= get_dht_time() + MAX_AHEAD_S[kind]

    @property
    def priority(self) -> int:
        return 5  # after RSASignatureValidator (10), which proves the subkey's owner wrote the value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, OwnerRules) and other.run_id == self.run_id


__all__ = ["OwnerRules", "key_id"]
