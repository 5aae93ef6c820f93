"""The swarm fabric over hivemind: a DHT for membership and version announcements (signed,
schema-checked records), libp2p streams for rollouts and weights. `HivemindFabric` implements the
fabric interface (interface.py); `HivemindBootstrap` is the DHT node peers join through."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping, Sequence

from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure
from hivemind.utils import get_dht_time

from swarm.fabric.hivemind.dht import announce_multiaddrs, listen_maddrs, start_dht
from swarm.fabric.hivemind.learner_group import LearnerGroup
from swarm.fabric.hivemind.records import (
    MembershipPublisher,
    authorised_learners,
    latest_announced,
    list_members,
    read_revoked,
    store_announcement,
)
from swarm.fabric.hivemind.rollouts import RolloutInbox, RolloutSender
from swarm.fabric.hivemind.weights import WeightClient, WeightServer
from swarm.fabric.membership.addresses import order_for_others
from swarm.fabric.membership.records import Heartbeat
from swarm.fabric.weights.announcement_push import PUSH_TIMEOUT_S, AnnouncementPusher
from swarm.fabric.weights.announcements import RunSampling, VersionAnnouncement
from swarm.fabric.weights.chunks import ChunkSpec


def visible_addresses(dht, announced: Sequence[str]) -> list[str]:
    """The node's full multiaddrs (with /p2p/ID), announced ones first, then public, private, loopback."""

    peer = dht.peer_id.to_base58()
    full = [a if "/p2p/" in a else f"{a}/p2p/{peer}" for a in announced]
    return order_for_others((str(m) for m in dht.get_visible_maddrs()), full)


class HivemindFabric:
    transport = "hivemind"

    def __init__(self, dht, validator, run_id: str, *, heartbeat_s: float, announced: Sequence[str] = (),
                 upload_slots: int | None = None, client_mode: bool = False, signing_key=None) -> None:

        self.dht, self.validator, self.run_id = dht, validator, run_id
        self.announced, self.upload_slots, self.client_mode = list(announced), upload_slots, client_mode
        self._owned: list = []  # inboxes, servers and clients made here: closed on shutdown
        self.certificate = ""  # a learner other than the run owner: the owner's certificate, carried in announcements
        self._members = MembershipPublisher(dht, run_id, validator.local_public_key, heartbeat_s=heartbeat_s)
        # the key that signs this peer's DHT records, to sign its pushed announcements alike (None:
        # an observer's fabric, which announces nothing)
        self.pusher = self._own(AnnouncementPusher(signing_key, lambda: self.weight_client(timeout_s=PUSH_TIMEOUT_S))) \
            if signing_key is not None else None

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    @property
    def public_key(self) -> bytes:
        return self.validator.local_public_key

    @property
    def heartbeat_s(self) -> float:
        return self._members.heartbeat_s

    def addresses(self) -> list[str]:
        """What other peers pass to --peers to join through this one, the best for others first."""
        return visible_addresses(self.dht, self.announced)

    @property
    def dialable(self) -> bool:
        """libp2p does not tell a peer reliably whether it is behind a NAT; --client-mode says so."""
        return not self.client_mode

    def now(self) -> float:
        return get_dht_time()

    def heartbeat(self, beat: Heartbeat) -> bool:
        return self._members.heartbeat(beat)

    def members(self):
        return list_members(self.dht, self.run_id)

    def authorised_learners(self, owners: Iterable[bytes]):
        """The live learners the run owners `owners` authorised, found from the owners' keys alone."""
        return authorised_learners(self.dht, self.run_id, owners)

    def revoked(self, owners: Iterable[bytes]) -> frozenset[str]:
        """Fingerprints of the learner keys the run owners `owners` revoked."""
        return read_revoked(self.dht, self.run_id, owners)

    def announce(self, version: int, digest: str, sampling: RunSampling = RunSampling(),
                 recent: Mapping[int, str] = {}, chunks: Sequence[ChunkSpec] = (),  # noqa: B006
                 sharers: Sequence[str] = (), ended: bool = False) -> bool:

        announcement = VersionAnnouncement.of(self.run_id, version, digest, self.peer_id, self.now(), sampling, recent,
                                              chunks, self.certificate, sharers, ended)
        if self.pusher is not None:
            self.pusher.push(announcement)  # the named sharers hear of it first, while the DHT stores it
        return store_announcement(self.dht, self.public_key, announcement)

    def learner_group(self, parameters, **options):
        """This learner's place in the run's gradient-averaging group (several learners)."""

        return self._own(LearnerGroup(self.dht, self.run_id, parameters, **options))

    def latest_announced(self, learner_keys: Iterable[bytes]):
        return latest_announced(self.dht, self.run_id, learner_keys)

    def rollout_inbox(self, **options):
        return self._own(RolloutInbox(self.dht, self.run_id, **options))

    def rollout_sender(self, **options):
        return self._own(RolloutSender(self.dht, self.run_id, **options))

    def weight_server(self, store):
        return self._own(WeightServer(self.dht, self.run_id, store, slots=self.upload_slots))

    def weight_client(self, **options):
        return self._own(WeightClient(self.dht, self.run_id, **options))

    def _own(self, component):
        self._owned.append(component)
        return component

    def unreachable_errors(self) -> tuple[type[BaseException], ...]:
        """What a call to a peer that is gone (or restarting) raises."""
        import asyncio

        return (ControlFailure, ConnectionError, TimeoutError, asyncio.IncompleteReadError, OSError)

    def shutdown(self) -> None:
        for component in self._owned:
            try:
                component.close()  # idempotent: peers usually closed them already
            except Exception:  # noqa: BLE001
                pass
        self._owned.clear()
        self.dht.shutdown()


class HivemindBootstrap:
    """A bootstrap node of a hivemind swarm: a DHT node (with a stable peer id when given a key file)."""

    transport = "hivemind"

    def __init__(self, run_id: str, *, host: str, port: int, identity_path: Path | None = None,
                 initial_peers: Sequence[str] = (), announce_addr: str | None = None) -> None:

        self.run_id = run_id
        port, self.announced = announce_multiaddrs(announce_addr, port)
        self.dht, _ = start_dht(run_id, initial_peers=list(initial_peers), host_maddrs=listen_maddrs(host, port),
                                announce_maddrs=self.announced, identity_path=identity_path, public=True)

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    def addresses(self) -> list[str]:
        return visible_addresses(self.dht, self.announced)

    def members(self):
        return list_members(self.dht, self.run_id)

    def shutdown(self) -> None:
        self.dht.shutdown()
