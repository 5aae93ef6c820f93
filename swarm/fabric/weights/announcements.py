"""What learners announce: the newest version of a run with the run's sampling settings
(`VersionAnnouncement`, schema-checked with strict types), signed under a learner key, read back by
samplers (over hivemind from the DHT, hivemind/records.py; over gRPC from the registry) and trusted
only under the run's owner keys or a key they certified (membership/authority.py).
"""



import logging
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from pydantic.v1 import BaseModel, StrictBool, StrictFloat, confloat, conint, conlist, constr

from swarm.config import GenerationSettings, default_of
from swarm.fabric.membership.authority import MAX_CERTIFICATE_CHARS, authorises
from swarm.fabric.membership.records import MAX_HOLDS_LISTED
from swarm.fabric.weights.chunks import KINDS, TOKEN_PATTERN, ChunkSpec

logger = logging.getLogger(__name__)

# sharers of a delta an announcement names (sharer_view.SharerView): a stripe each; the
# delta is cut into about 32 chunks, so more would own none
MAX_ANNOUNCED_SHARERS = 64


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
    # a LoRA run (swarm/lora.py): versions are the adapter's tensors, over the base model of this
    # hash; samplers build the same adapter (rank, alpha, target modules) on it. 0: full fine-tuning
    lora_r: int = 0
    lora_alpha: float = 0.0
    lora_targets: tuple[str, ...] = ()
    base_hash: str = ""  # state_hash of the base model's state (swarm.lora.base_state): every peer's must match


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
    # how this version's payloads are chunked (swarm.fabric.weights.chunks): the root of each one's chunk
    # digests, so that any peer may pass on verified chunks of it ("KIND:VERSION:SIZE:CHUNK:ROOT")
    chunks: conlist(constr(regex=TOKEN_PATTERN, strict=True), max_items=len(KINDS)) = []
    # an announcement by a learner other than the run owner carries the owner's certificate for it
    certificate: constr(max_length=MAX_CERTIFICATE_CHARS, strict=True) = ""
    # the peers that fetch this version's delta in chunks, by the learner's view of the members
    # (sharer_view.SharerView), in the order of their chain (slow links last): every sampler
    # deals the stripes out among the same peers, or makes the same chain, and none has to look
    # the members up before it starts
    sharers: conlist(constr(min_length=1, max_length=128, strict=True), max_items=MAX_ANNOUNCED_SHARERS) = []
    # the learner trained its last step: this version is the run's last and samplers may leave. Only
    # ever read from an announcement signed under the run's keys, like the version itself (a sampler
    # trusts no one else's "run ended"); peers that predate the field ignore it
    ended: StrictBool = False
    # a LoRA run: the adapter's rank, alpha and target modules, and the frozen base model's hash
    # (RunSampling's fields of the same names); absent in a full fine-tuning run
    lora_r: conint(ge=0, le=1 << 16, strict=True) = 0
    lora_alpha: confloat(ge=0, le=1e6, strict=True) = 0.0
    lora_targets: conlist(constr(min_length=1, max_length=64, regex=r"^[A-Za-z0-9_.]+$", strict=True), max_items=64) = []
    base_hash: constr(regex=r"^([0-9a-f]{64})?$", strict=True) = ""

    @classmethod
    def of(cls, run_id: str, version: int, digest: str, peer_id: str, now: float, sampling: RunSampling,
           recent: Mapping[int, str] = {}, chunks: Sequence[ChunkSpec] = (),  # noqa: B006
           certificate: str = "", sharers: Sequence[str] = (), ended: bool = False) -> "VersionAnnouncement":
        return cls(certificate=certificate, sharers=list(dict.fromkeys(sharers))[:MAX_ANNOUNCED_SHARERS], run_id=run_id, ended=ended,
                   version=version, hash=digest, peer_id=peer_id, time=float(now),
                   temperature=float(sampling.temperature), top_k=int(sampling.top_k), top_p=float(sampling.top_p),
                   max_tokens=int(sampling.max_tokens), stop=list(sampling.stop), lora_r=int(sampling.lora_r),
                   lora_alpha=float(sampling.lora_alpha), lora_targets=list(sampling.lora_targets),
                   base_hash=sampling.base_hash,
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
        return RunSampling(self.temperature, self.top_k, self.top_p, self.max_tokens, tuple(self.stop), self.lora_r,
                           self.lora_alpha, tuple(self.lora_targets), self.base_hash)


def versions_key(run_id: str) -> str:
    return f"{run_id}_versions"


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
    ended: bool = False  # the run's last version: its learner finished the run (VersionAnnouncement.ended)


def newest_authorised(items: Iterable[tuple[bytes, dict]], learner_keys: Iterable[bytes], run_id: str) -> Announced | None:
    """Of (owner key, announcement) pairs, the newest well-formed one of `run_id` whose key is one of
    `learner_keys` (the run's owner keys) or carries their certificate for it (swarm.fabric.membership.authority).
    Its `peers` are every authorised learner announcing that version with that hash: where to send
    rollouts when several learners train the run."""

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
                     tuple(best.sharers), best.ended)
