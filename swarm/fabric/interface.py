"""The written interface of the swarm fabric: what every transport gives peers.

Peers and tools use only these methods, with these signatures; `hivemind.fabric.HivemindFabric`
(DHT + libp2p streams) and `grpc.fabric.GrpcFabric` (registry + gRPC servers) implement them, and
the same tests run over both (tests/fabric/test_fabric_interface.py checks the signatures match). The one
place a transport is chosen is `transports.py`.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Protocol, Sequence, runtime_checkable

from swarm.fabric.membership.records import Heartbeat, Member
from swarm.fabric.weights.announcements import Announced, RunSampling
from swarm.fabric.weights.chunks import ChunkSpec
from swarm.fabric.weights.versions import FetchResult, VersionStore
from swarm.rollouts import RolloutGroup


class JoinError(RuntimeError):
    """None of the initial peers (or the registry) could be reached."""


class RolloutInbox(Protocol):
    """A learner's inbox: validated groups, each delivered at most once, oldest first."""

    learner_version: int  # set by the learner as it steps: bounds what the inbox accepts

    def get(self, timeout: float | None = None) -> RolloutGroup | None: ...

    def qsize(self) -> int: ...

    def penalise(self, peer: str, reason: str, *, ban: bool = False) -> None:
        """Count a refusal that is the sender's fault (repeated ones ban the peer; `ban`: at once)."""

    def close(self) -> None: ...


class RolloutSender(Protocol):
    def send(self, learner_peer: str, groups: Sequence[RolloutGroup]) -> list[dict]:
        """One ack per group, in order: {"ok": True} or {"ok": False, "reason": ...}."""

    def send_frames(self, learner_peer: str, frames: Sequence[bytes]) -> list[dict]:
        """Raw wire frames (tests send malformed ones)."""

    def close(self) -> None: ...


class WeightServer(Protocol):
    """Serves the versions held in a `VersionStore` to any peer that asks."""

    served: int

    def close(self) -> None: ...


class WeightClient(Protocol):
    def fetch(self, holder: str, want: int, want_hash: str, store: VersionStore,
              known: Mapping[int, str] | None = None, timeout_s: float | None = None) -> FetchResult:
        """Version `want` from `holder`, rebuilt and verified against `want_hash`, added to `store`
        (with the versions on the way whose hashes `known` vouches for). Raises CorruptVersion
        (nothing added) when it does not verify, HolderBusy when the holder's slots are taken;
        `timeout_s`: a shorter limit than the client's on each request (a relay's attempt)."""

    def close(self) -> None: ...


@runtime_checkable
class Fabric(Protocol):
    transport: str  # "hivemind" or "grpc"
    run_id: str  # the run it joined

    @property
    def peer_id(self) -> str:
        """This peer's id in the transport (base58 libp2p id, or KEYID@host:port over gRPC)."""

    @property
    def public_key(self) -> bytes:
        """The `[owner:...]` bytes of the key that signs this peer's records."""

    @property
    def heartbeat_s(self) -> float:
        """Seconds between membership heartbeats (records expire a few heartbeats later)."""

    def addresses(self) -> list[str]:
        """What other peers pass to --peers to join through this one."""

    @property
    def dialable(self) -> bool:
        """Whether other peers can open connections to this one, as far as it can tell: False behind
        a NAT it knows of (then it offers no versions to relay: every try would be a failed dial)."""

    def now(self) -> float:
        """The clock membership records are stamped with (seconds)."""

    def heartbeat(self, beat: Heartbeat) -> bool:
        """Publish this peer's membership record; False when the swarm refused it."""

    def members(self) -> list[Member]:
        """Current, unexpired members of the run, sorted by role and peer id."""

    def announce(self, version: int, digest: str, sampling: RunSampling = RunSampling(),
                 recent: Mapping[int, str] = {}, chunks: Sequence[ChunkSpec] = (),  # noqa: B006
                 sharers: Sequence[str] = (), ended: bool = False) -> bool:
        """Announce a published version, the run's sampling settings, the hashes of the versions
        just before it (`recent`, version -> hash), how its payloads are chunked (`chunks`:
        VersionStore.chunk_specs) and who fetches its delta in chunks (`sharers`:
        sharer_view.SharerView), under this peer's signing key. The named sharers are also sent
        it directly, once per version (announcement_push), so they start without a poll. `ended`:
        this version is the run's last (the learner trained its last step); samplers then leave."""

    def latest_announced(self, learner_keys: Iterable[bytes]) -> Announced | None:
        """The newest announcement signed by one of `learner_keys` (all others are ignored)."""

    def rollout_inbox(self, **options) -> RolloutInbox: ...

    def rollout_sender(self, **options) -> RolloutSender: ...

    def weight_server(self, store: VersionStore) -> WeightServer: ...

    def weight_client(self, **options) -> WeightClient: ...

    def unreachable_errors(self) -> tuple[type[BaseException], ...]:
        """What a call to a peer that is gone (or restarting) raises."""

    def shutdown(self) -> None:
        """Close everything this fabric made (idempotent)."""


class BootstrapNode(Protocol):
    """The entry point peers join through: a DHT node, or the gRPC registry."""

    transport: str

    @property
    def peer_id(self) -> str: ...

    def addresses(self) -> list[str]: ...

    def members(self) -> list[Member]: ...

    def shutdown(self) -> None: ...
