"""Membership records in the DHT, under a run id.

Each peer owns one subkey of the dictionary key `{run_id}_members`: its subkey embeds its RSA
public key (`[owner:...]`), the value is signed with the matching private key, so hivemind's
RSASignatureValidator refuses any write to it by another peer; SchemaValidator refuses values that
do not match MemberRecord (strict types: no silent conversions). Records carry an expiration a few
heartbeats ahead, so a peer that vanishes disappears from listings on its own.
"""


from dataclasses import asdict, dataclass
from typing import Dict, Mapping, Optional, Sequence

from pydantic.v1 import BaseModel, StrictBool, StrictFloat, confloat, conint, conlist, constr

from swarm import __version__
from swarm.config import GenerationSettings, SwarmSettings, default_of
from swarm.fabric.chunks import KINDS, TOKEN_PATTERN, ChunkSpec
from swarm.fabric.authority import MAX_CERTIFICATE_CHARS

ROLES = ("sampler", "learner")
EXPIRY_HEARTBEATS = 3.0  # a record outlives its last heartbeat by this many heartbeat intervals
MAX_HOLDS_LISTED = 16  # versions a membership record lists as held (the newest)
# sharers of a delta an announcement names (chunked_fetch.SharerView): a stripe each; the
# delta is cut into about 32 chunks, so more would own none
MAX_ANNOUNCED_SHARERS = 64
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
    own "learner unreachable"); a group the learner's wire checks (swarm.fabric.wire) refused is
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
    # fetching the same payload share its chunks out among such relays (swarm.fabric.chunked_fetch)
    relay: StrictBool = False
    # a learner other than the run owner: the owner's certificate for its key (swarm.fabric.authority)
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


@dataclass(frozen=True)
class RunSampling:
    """The run's sampling settings, set by the learner and carried in its signed announcements:
    samplers generate with them, and the learner refuses groups sampled otherwise (a learner steps
    on one sampling distribution)."""

    temperature: float = default_of(GenerationSettings, "temperature")
    top_k: int = default_of(GenerationSettings, "top_k")
    top_p: float = default_of(GenerationSettings, "top_p")
    max_tokens: int = default_of(GenerationSettings, "max_completion_length")  # longest completion
    stop: tuple[str, ...] = ()  # a completion ends with the first of these it writes


class VersionAnnouncement(BaseModel):
    """A learner's announcement of its newest published policy version and the run's sampling
    settings. It names its run: a learner keeps its key across runs, and a signed announcement of
    run A must not count in run B."""

    run_id: constr(min_length=1, max_length=64, strict=True)
    version: conint(ge=0, strict=True)
    hash: constr(regex=r"^[0-9a-f]{64}$", strict=True)  # state_hash of the published weights
    peer_id: constr(min_length=1, max_length=128, strict=True)  # where to fetch it first
    time: StrictFloat
    temperature: confloat(gt=0, le=100, strict=True)
    top_k: conint(ge=0, le=1 << 20, strict=True)
    top_p: confloat(gt=0, le=1, strict=True)
    max_tokens: conint(ge=1, le=1 << 20, strict=True)
    stop: conlist(constr(min_length=1, max_length=64, strict=True), max_items=16) = []
    # the hashes of the versions just before this one ("VERSION:HASH"), so that a sampler can take
    # one of those from a relay, verified, while the newest is still spreading
    recent: conlist(constr(regex=r"^[0-9]{1,12}:[0-9a-f]{64}$", strict=True), max_items=MAX_HOLDS_LISTED) = []
    # how this version's payloads are chunked (swarm.fabric.chunks): the root of each one's chunk
    # digests, so that any peer may pass on verified chunks of it ("KIND:VERSION:SIZE:CHUNK:ROOT")
    chunks: conlist(constr(regex=TOKEN_PATTERN, strict=True), max_items=len(KINDS)) = []
    # an announcement by a learner other than the run owner carries the owner's certificate for it
    certificate: constr(max_length=MAX_CERTIFICATE_CHARS, strict=True) = ""
    # the peers that fetch this version's delta in chunks, by the learner's view of the members
    # (chunked_fetch.SharerView), in the order of their chain (slow links last): every sampler
    # deals the stripes out among the same peers, or makes the same chain, and none has to look
    # the members up before it starts
    sharers: conlist(constr(min_length=1, max_length=128, strict=True), max_items=MAX_ANNOUNCED_SHARERS) = []

    @classmethod
    def of(cls, run_id: str, version: int, digest: str, peer_id: str, now: float, sampling: RunSampling,
           recent: Mapping[int, str] = {}, chunks: Sequence[ChunkSpec] = (),  # noqa: B006
           certificate: str = "", sharers: Sequence[str] = ()) -> "VersionAnnouncement":
        return cls(certificate=certificate, sharers=list(dict.fromkeys(sharers))[:MAX_ANNOUNCED_SHARERS], run_id=run_id,
                   version=version, hash=digest, peer_id=peer_id, time=float(now),
                   temperature=float(sampling.temperature), top_k=int(sampling.top_k), top_p=float(sampling.top_p),
                   max_tokens=int(sampling.max_tokens), stop=list(sampling.stop),
                   recent=[f"{v}:{h}" for v, h in sorted(recent.items())[-MAX_HOLDS_LISTED:] if v != version],
                   chunks=[spec.token for spec in chunks if spec.version == version][:len(KINDS)])

    @property
    def recent_hashes(self) -> dict[int, str]:
        return {int(v): h for v, _, h in (item.partition(":") for item in self.recent)}

    @property
    def chunk_specs(self) -> dict[str, ChunkSpec]:
        """kind -> spec of this version's chunked payloads (malformed or out-of-bounds ones dropped)."""
        specs = {}
        for token in self.chunks:
            try:
                spec = ChunkSpec.parse(token)
            except ValueError:
                continue
            if spec.version == self.version:
                specs.setdefault(spec.kind, spec)
        return specs

    @property
    def sampling(self) -> RunSampling:
        return RunSampling(self.temperature, self.top_k, self.top_p, self.max_tokens, tuple(self.stop))


def members_key(run_id: str) -> str:
    return f"{run_id}_members"


def versions_key(run_id: str) -> str:
    return f"{run_id}_versions"


def make_schema(run_id: str):
    """A schema class per run: SchemaValidator identifies fields by the hash of `{prefix}_{name}`."""
    from hivemind.dht.schema import BytesWithPublicKey

    class SwarmSchema(BaseModel):
        members: Dict[BytesWithPublicKey, Optional[MemberRecord]]
        versions: Dict[BytesWithPublicKey, Optional[VersionAnnouncement]]

    return SwarmSchema


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

    def record(self, peer_id: str, now: float) -> "MemberRecord":
        fields = asdict(self)
        fields.update(heartbeat_s=float(self.heartbeat_s), refused=int(self.refused), refused_in_a_row=int(self.refused_in_a_row),
                      step_s=min(float(self.step_s), MAX_SECONDS), since_step_s=min(max(float(self.since_step_s), 0.0), MAX_SECONDS))
        fields.update(model=self.model[:256], version=int(self.version), rollouts=int(self.rollouts), relay=bool(self.relay),
                      tokens_per_s=float(self.tokens_per_s), holds=[int(v) for v in sorted(self.holds)[-MAX_HOLDS_LISTED:]],
                      fetch_version=int(self.fetch_version), fetch_from=self.fetch_from[:128],
                      fetch_bytes=int(self.fetch_bytes), fetch_s=float(self.fetch_s),
                      fetch_transfer_s=min(max(float(self.fetch_transfer_s), 0.0), MAX_SECONDS))
        return MemberRecord(peer_id=peer_id, software=__version__, time=float(now), **fields)


@dataclass
class Member:
    """A membership record as read back from the DHT."""

    record: MemberRecord
    expires_at: float
    owner: bytes  # the subkey, i.e. the owner's public key


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
        from hivemind.utils import get_dht_time

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
        try:
            record = MemberRecord.parse_obj(item.value)
        except Exception:  # noqa: BLE001  a record another version wrote: skip it
            continue
        members.append(Member(record=record, expires_at=item.expiration_time, owner=subkey))
    return sorted(members, key=lambda m: (m.record.role, m.record.peer_id))
