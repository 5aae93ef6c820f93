"""Membership records: what a peer says about itself (`Heartbeat`), the schema-checked record
it becomes (`MemberRecord`, strict types: no silent conversions) and how it reads back (`Member`).
Each transport stores them under the run id, one record per signing key, with an expiration a few
heartbeats ahead, so a peer that vanishes disappears from listings on its own (over hivemind:
hivemind/records.py; over gRPC: the registry).
"""


import hashlib
import re
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

from pydantic.v1 import BaseModel, StrictBool, StrictFloat, confloat, conint, conlist, constr

from swarm import __version__
from swarm.fabric.membership.authority import MAX_CERTIFICATE_CHARS
from swarm.fabric.signing import canonical_owner

ROLES = ("sampler", "learner")
EXPIRY_HEARTBEATS = 3.0  # a record outlives its last heartbeat by this many heartbeat intervals
MAX_HOLDS_LISTED = 16  # versions a membership record lists as held (the newest)
MAX_SECONDS = 1e9  # a duration in a record (about 30 years): bounds what a peer may claim
# Why a learner refused a sampler's groups, as a sampler's record says it (a fixed set: a record
# carries no free text of the learner's): its version was too old / from the future, the learner's
# queue was full, the learner is shutting down, the sampler is banned, a group sent before, one the
# learner could not take (malformed, too large: another model or software version?), too many
# streams open at the learner, the learner could not be reached; anything else.
REFUSALS = ("stale", "future", "busy", "leaving", "banned", "duplicate", "malformed", "streams", "unreachable", "other")
_REFUSAL_WORDS = (("steps stale", "stale"), ("from the future", "future"), ("leaving", "leaving"), ("banned", "banned"),
                  ("duplicate", "duplicate"), ("rollout streams", "streams"), ("unreachable", "unreachable"),
                  ("busy", "busy"))


def refusal_category(reason: str) -> str:
    """The REFUSALS entry for a learner's refusal `reason` (the text of its ack, or the sampler's
    own "learner unreachable"); a group the learner's wire checks (swarm.fabric.rollouts.wire) refused is
    "malformed"."""
    text = str(reason)
    for words, kind in _REFUSAL_WORDS:
        if words in text:
            return kind
    malformed = ("could not be decoded", "exceeds", "must", "outside the vocabulary", "not a msgpack", "wire format",
                 "need ", "lengths sum", "log-probs for", "not a map", "tokens but")
    return "malformed" if any(words in text for words in malformed) else "other"


@dataclass
class Refusals:
    """A sampler's tally of the learner's refusals, for its record: in all, in a row since a group
    was last accepted, and the last one's REFUSALS kind."""

    total: int = 0
    in_a_row: int = 0
    last: str = ""

    def count(self, acks: Sequence[Mapping]) -> None:
        """Count one send's acks ({"ok": bool, "reason": str}), in order."""
        for ack in acks:
            if ack.get("ok"):
                self.in_a_row = 0
            else:
                self.total, self.in_a_row, self.last = self.total + 1, self.in_a_row + 1, refusal_category(ack.get("reason", ""))


class MemberRecord(BaseModel):
    """What a peer announces about itself (all fields required by the schema)."""

    role: constr(regex=r"^(sampler|learner)$", strict=True)
    peer_id: constr(min_length=1, max_length=128, strict=True)  # libp2p peer id (base58)
    model: constr(max_length=256, strict=True)  # model name or path the peer runs
    model_hash: constr(max_length=128, strict=True)  # hash of the weights it holds ("" if unknown)
    version: conint(ge=0, strict=True)  # policy version it holds
    rollouts: conint(ge=0, strict=True)  # counters: rollout groups produced (sampler) / used (learner)
    tokens_per_s: StrictFloat  # recent throughput
    software: constr(max_length=32, strict=True)  # gepo-swarm version
    time: StrictFloat  # DHT time of the heartbeat
    # the versions this peer serves to others (newest last): where samplers fetch a version from
    holds: conlist(conint(ge=0, strict=True), max_items=MAX_HOLDS_LISTED) = []
    # its last version fetch: which version, from which peer, how many bytes in how many seconds
    fetch_version: conint(ge=-1, strict=True) = -1
    fetch_from: constr(max_length=128, strict=True) = ""
    fetch_bytes: conint(ge=0, strict=True) = 0
    fetch_s: confloat(ge=0, strict=True) = 0.0
    # ... of which its payload's transfer took these (the rest: applying it); 0 from older peers
    fetch_transfer_s: confloat(ge=0, le=MAX_SECONDS, strict=True) = 0.0
    # whether it passes on the chunks of versions it is receiving (a dialable sampler): peers
    # fetching the same payload share its chunks out among such relays (swarm.fabric.weights.chunked_fetch)
    relay: StrictBool = False
    # a learner other than the run owner: the owner's certificate for its key (swarm.fabric.membership.authority)
    certificate: constr(max_length=MAX_CERTIFICATE_CHARS, strict=True) = ""
    # what `swarm status` flags come from (swarm.health); 0 / "" from peers older than these fields.
    # the seconds between its heartbeats (a record later than a few of them is late)
    heartbeat_s: confloat(ge=0, le=MAX_SECONDS, strict=True) = 0.0
    # a sampler: groups the learner refused in all, those refused in a row since one was accepted,
    # and why the last one was (one of REFUSALS)
    refused: conint(ge=0, strict=True) = 0
    refused_in_a_row: conint(ge=0, strict=True) = 0
    refusal: constr(regex=f"^({'|'.join(REFUSALS)})?$", strict=True) = ""
    # a learner: its usual seconds between steps (median of recent steps; 0 before the first) and
    # the seconds since its last step (or since it started, before the first), at `time`
    step_s: confloat(ge=0, le=MAX_SECONDS, strict=True) = 0.0
    since_step_s: confloat(ge=0, le=MAX_SECONDS, strict=True) = 0.0
    # its last record, written as it shuts down: listings leave it out at once rather than when
    # the record expires (a learner's team would otherwise wait out a round for it, samplers
    # would ask it for chunks)
    leaving: StrictBool = False


# A peer id a record may name, where it is read to be dialled (a fetch's holders, a chain's
# sharers): a libp2p id in base58, or a gRPC peer's `KEYID@host:port` (a bare `host:port` too).
# Records are data: one naming anything else is skipped there, never dialled (a hivemind client
# raised ValueError on an id that is not base58, out of every sampler's fetch: issue 45)
_BASE58_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{1,%d}" % 128)
_GRPC_ID = re.compile(r"(?:[0-9a-f]{16}@)?(?:\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9.-]{1,100}):[0-9]{1,5}")


def dialable_peer_id(peer_id) -> bool:
    """Whether `peer_id` (read from a record or an announcement) has the form of a peer id either
    transport can dial: what a fetch may ask. Nothing is looked up."""
    if not isinstance(peer_id, str) or len(peer_id) > 128:
        return False
    if _BASE58_ID.fullmatch(peer_id):
        return True
    match = _GRPC_ID.fullmatch(peer_id)
    return match is not None and 0 < int(peer_id.rpartition(":")[2]) < 65536


def believable_holds(record, newest: int | None = None) -> frozenset[int] | None:
    """The versions a record lists as held that a fetch may believe, or None: the record is not to
    be used at all (its peer id cannot be dialled, or it lists a version past `newest`, the newest
    one announced: a record claiming versions not out yet lies about every one). The schema bounds
    the list already (MAX_HOLDS_LISTED non-negative ints); it is bounded again here, as read."""
    holds = getattr(record, "holds", None)
    if not dialable_peer_id(getattr(record, "peer_id", None)) or not isinstance(holds, (list, tuple)):
        return None
    listed = holds[:MAX_HOLDS_LISTED]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in listed):
        return None
    if newest is not None and any(v > newest for v in listed):
        return None
    return frozenset(listed)


MEMBER_PAGES = 16  # DHT keys a run's membership records are spread over, by key (hivemind/records.py)


def member_page(owner: bytes) -> int:
    """The page a key's membership record belongs in (its key's canonical text, hashed)."""
    return int.from_bytes(hashlib.sha256(canonical_owner(owner)).digest()[:4], "big") % MEMBER_PAGES


def member_page_key(run_id: str, page: int) -> str:
    return f"{run_id}_members_{page}"


def members_key(run_id: str, owner: bytes) -> str:
    """The DHT key of the page the membership record of `owner` (a public-key subkey) is stored in."""
    return member_page_key(run_id, member_page(owner))


@dataclass(frozen=True)
class Heartbeat:
    """What a peer says about itself in its membership record (the transport adds its peer id, the
    software version and the time)."""

    role: str  # "sampler" or "learner"
    model: str = ""  # model name or path (first 256 characters)
    model_hash: str = ""  # hash of the weights it holds ("" if unknown)
    version: int = 0  # policy version it holds
    rollouts: int = 0  # rollout groups produced (sampler) / used (learner)
    tokens_per_s: float = 0.0  # recent throughput
    holds: tuple[int, ...] = ()  # versions it serves to others
    fetch_version: int = -1  # its last fetch (-1: none yet): version, source peer, bytes, seconds
    fetch_from: str = ""
    fetch_bytes: int = 0
    fetch_s: float = 0.0
    fetch_transfer_s: float = 0.0  # of fetch_s, until the payload was all here
    relay: bool = False  # passes on chunks of the versions it receives
    certificate: str = ""  # a learner other than the run owner: the owner's certificate for it
    heartbeat_s: float = 0.0  # seconds between its heartbeats
    refused: int = 0  # a sampler: groups the learner refused, in all and in a row; the last one's REFUSALS kind
    refused_in_a_row: int = 0
    refusal: str = ""
    step_s: float = 0.0  # a learner: usual seconds between steps (0: none yet), seconds since the last one
    since_step_s: float = 0.0
    leaving: bool = False  # its last record, as it shuts down

    def record(self, peer_id: str, now: float) -> "MemberRecord":
        fields = asdict(self)
        fields.update(heartbeat_s=float(self.heartbeat_s), refused=int(self.refused), refused_in_a_row=int(self.refused_in_a_row),
                      step_s=min(float(self.step_s), MAX_SECONDS), since_step_s=min(max(float(self.since_step_s), 0.0), MAX_SECONDS))
        fields.update(model=self.model[:256], version=int(self.version), rollouts=int(self.rollouts), relay=bool(self.relay),
                      tokens_per_s=float(self.tokens_per_s), holds=[int(v) for v in sorted(self.holds)[-MAX_HOLDS_LISTED:]],
                      fetch_version=int(self.fetch_version), fetch_from=self.fetch_from[:128],
                      fetch_bytes=int(self.fetch_bytes), fetch_s=float(self.fetch_s), leaving=bool(self.leaving),
                      fetch_transfer_s=min(max(float(self.fetch_transfer_s), 0.0), MAX_SECONDS))
        return MemberRecord(peer_id=peer_id, software=__version__, time=float(now), **fields)


@dataclass
class Member:
    """A membership record as read back from the DHT."""

    record: MemberRecord
    expires_at: float
    owner: bytes  # the subkey, i.e. the owner's public key
