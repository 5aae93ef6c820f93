"""`GrpcFabric`: a peer of a gRPC swarm (see grpc/common.py), which implements the fabric
interface (interface.py) like `HivemindFabric` does. It runs its own server (grpc/server.py) for
rollouts (grpc/rollouts.py) and weights (grpc/weights.py), and reaches other peers and the
registry (grpc/registry.py) over a pool of channels.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable, Mapping, Sequence

import grpc

from swarm.fabric.grpc.common import SERVICE, RequestSigner, key_id, pack, peer_id_of, unpack
from swarm.fabric.grpc.registry import MAX_MEMBER_PAGES, members_from
from swarm.fabric.grpc.rollouts import GrpcRolloutInbox, GrpcRolloutSender
from swarm.fabric.grpc.server import Channels, GrpcPeerServer
from swarm.fabric.grpc.tls import INSECURE_WARNING
from swarm.fabric.grpc.weights import GrpcWeightClient, GrpcWeightServer
from swarm.fabric.interface import JoinError
from swarm.fabric.membership.addresses import (
    announced_address,
    host_port,
    interface_addresses,
    is_wildcard,
    outbound_address,
    refused_join,
    usable_ip,
)
from swarm.fabric.membership.authority import CertificateError, Revocations, parse_revocations
from swarm.fabric.membership.records import EXPIRY_HEARTBEATS, Heartbeat
from swarm.fabric.signing import canonical_owner, owner_key, signed_value, verify_owner_signature
from swarm.fabric.weights.announcement_push import PUSH_TIMEOUT_S, AnnouncementPusher
from swarm.fabric.weights.announcements import Announced, RunSampling, VersionAnnouncement, newest_authorised
from swarm.fabric.weights.chunks import ChunkSpec

logger = logging.getLogger(__name__)


def _verified_announcements(listed: list, keys: set[bytes]) -> list[tuple[bytes, dict]]:
    """(owner, announcement) of each listed item that one of `keys` signed. A registry's reply is
    read as untrusted: fields must already be bytes (never bytes(n): bytes(2**34) allocates 16 GiB),
    and a payload is unpacked only once its signature holds."""
    items = []
    for item in listed:
        fields = [item.get(k) for k in ("owner", "payload", "signature")] if isinstance(item, dict) else []
        if len(fields) != 3 or not all(isinstance(f, bytes) for f in fields) or fields[0] not in keys:
            continue
        if verify_owner_signature(*fields):
            try:
                items.append((fields[0], unpack(fields[1])))
            except Exception:  # noqa: BLE001  signed garbage is still garbage: skip it
                continue
    return items


def _canonical_or_none(subkey) -> bytes | None:
    try:
        return canonical_owner(subkey) if isinstance(subkey, bytes) else None
    except ValueError:
        return None


class GrpcFabric:
    transport = "grpc"
    member_pages = MAX_MEMBER_PAGES  # Members pages one listing follows at most

    def __init__(self, registry: str, run_id: str, signing_key, *, host: str = "127.0.0.1", port: int = 0,
                 heartbeat_s: float, expiry_heartbeats: float = EXPIRY_HEARTBEATS, serve: bool = True,
                 timeout_s: float = 10.0, announce_addr: str | None = None, upload_slots: int | None = None,
                 insecure: bool = False) -> None:
        """registry: its KEYID@HOST:PORT (HOST:PORT: its TLS key trusted on first use); insecure: no
        TLS, for a registry and peers that run --insecure too (grpc/tls.py)."""
        self.registry, self.run_id, self.signing_key, self.insecure = registry, run_id, signing_key, insecure
        if insecure:
            logger.warning(INSECURE_WARNING)
        self._heartbeat_s, self.expiry_s, self.timeout_s = heartbeat_s, heartbeat_s * expiry_heartbeats, timeout_s
        self.upload_slots = upload_slots
        self._dialable = serve
        self.key_id = key_id(owner_key(signing_key))
        self.channels = Channels(insecure=insecure)
        self.pusher = AnnouncementPusher(signing_key, lambda: self.weight_client(timeout_s=PUSH_TIMEOUT_S))
        self.server = GrpcPeerServer(host, port, run_id, signing_key=signing_key, insecure=insecure) if serve else None
        # the key id alone until the address others dial is known (an observer serves nothing and keeps it)
        self.signer = RequestSigner(signing_key, run_id, self.key_id)
        self._check_registry()
        if self.server is not None:
            self.server.address = self._address_for_others(host, announce_addr)
            self.signer = RequestSigner(signing_key, run_id, self.peer_id)

    def _address_for_others(self, host: str, announce_addr: str | None) -> str:
        """HOST:PORT that other peers dial: the announced one; this peer's own when it listens on one
        address; listening on every interface, the address the registry sees it call from (its NAT's
        public address behind one), or this machine's outbound address when that is loopback (a
        registry on the same machine says nothing about what others can dial)."""

        port = self.server.port
        if announce_addr:
            return announced_address(announce_addr, port)
        if not is_wildcard(host):
            return host_port(host, port)
        try:
            reply = self._call("Observe", {"run_id": self.run_id})
        except grpc.RpcError as exc:  # a registry of an older version: this machine's own idea of it
            logger.warning("the registry cannot say which address it sees (%s); telling others %s", exc.code(), outbound_address())
            reply = {}
        seen = usable_ip(reply.get("ip") if isinstance(reply, dict) else None)
        if seen is None:
            seen = outbound_address() or "127.0.0.1"
        elif ":" not in seen and seen not in interface_addresses():  # (interface_addresses lists IPv4)
            # the registry sees another address than any of this machine's: a NAT is in between,
            # and without --announce-addr (a forwarded port) nobody can dial this peer
            self._dialable = False
            logger.info("behind a NAT (the registry sees %s): this peer relays no versions", seen)
        return host_port(seen, port)

    def _call(self, method: str, request: dict) -> dict:
        """One signed registry call (the request streamed as one message: see grpc.common)."""
        path, body = f"/{SERVICE}.Registry/{method}", pack(request)
        call = self.channels.get(self.registry).stream_unary(path, request_serializer=None, response_deserializer=unpack)
        return call(iter([body]), timeout=self.timeout_s, metadata=self.signer.metadata(path, body))

    def _check_registry(self) -> None:
        refused = refused_join("grpc", [self.registry])
        if refused:  # gRPC would retry until its timeout
            self.shutdown()
            raise JoinError(refused)
        try:
            grpc.channel_ready_future(self.channels.get(self.registry)).result(timeout=self.timeout_s)
        except ConnectionError as exc:  # TLS: no TLS there, or a registry holding another key than its address names
            self.shutdown()
            raise JoinError(f"could not join the swarm through the registry at {self.registry}: {exc}") from None
        except grpc.FutureTimeoutError:
            self.shutdown()
            raise JoinError(f"could not join the swarm through the registry at {self.registry}: no answer within "
                            f"{self.timeout_s:.0f}s. Check that `swarm bootstrap --transport grpc` runs there and is reachable") from None

    @property
    def peer_id(self) -> str:
        """`KEYID@host:port`: this peer's key id and the address it serves on (grpc.common)."""
        return peer_id_of(self.key_id, self.server.address) if self.server else ""

    @property
    def public_key(self) -> bytes:
        return owner_key(self.signing_key)

    @property
    def heartbeat_s(self) -> float:
        return self._heartbeat_s

    def addresses(self) -> list[str]:
        return [self.registry]  # over gRPC, peers join through the registry

    @property
    def dialable(self) -> bool:
        return self._dialable

    def now(self) -> float:
        return time.time()

    def heartbeat(self, beat: Heartbeat) -> bool:
        record = beat.record(self.peer_id, self.now()).dict()
        reply = self._call("Heartbeat", {"run_id": self.run_id, "record": record, "expiry_s": self.expiry_s})
        if not reply.get("ok"):
            logger.warning("registry refused our record: %s", reply.get("reason"))
        return bool(reply.get("ok"))

    def members(self):
        """Every member, page by page (each reply stays under the registry's message limit), at
        most `member_pages` pages: a registry cannot keep a peer reading forever."""

        listed, after = [], None
        for _ in range(self.member_pages):
            reply = self._call("Members", {"run_id": self.run_id, "after": after})
            page = reply.get("members") if isinstance(reply, dict) else None
            if not isinstance(page, list):
                break  # a malformed reply ends the listing (members_from skips malformed entries)
            listed += page
            after = reply.get("next")
            if not isinstance(after, str):
                break
        else:
            logger.warning("the registry lists more than %d pages of members; showing the first", self.member_pages)
        return members_from(listed)

    def announce(self, version: int, digest: str, sampling: RunSampling = RunSampling(),
                 recent: Mapping[int, str] = {}, chunks: Sequence[ChunkSpec] = (),  # noqa: B006
                 sharers: Sequence[str] = (), ended: bool = False) -> bool:

        announcement = VersionAnnouncement.of(self.run_id, version, digest, self.peer_id, time.time(), sampling, recent,
                                              chunks, sharers=sharers, ended=ended)
        self.pusher.push(announcement)  # the named sharers hear of it first, while the registry stores it
        reply = self._call("Announce", {"run_id": self.run_id, **signed_value(self.signing_key, announcement.dict())})
        return bool(reply.get("ok"))

    def latest_announced(self, learner_keys: Iterable[bytes]) -> Announced | None:
        """The newest announcement under `learner_keys`, each signature checked here again (the
        registry is not trusted with the learners' authority)."""
        learner_keys = list(learner_keys)
        # asking for the keys we follow keeps the reply small however many other keys announce
        reply = self._call("Versions", {"run_id": self.run_id, "owners": learner_keys})
        listed = reply.get("versions") if isinstance(reply, dict) else None
        items = _verified_announcements(listed if isinstance(listed, list) else [], set(learner_keys))
        return newest_authorised(items, learner_keys, self.run_id)

    def publish_revocations(self, revocations: Revocations) -> tuple[bool, str]:
        """Post this key's revocation list (authority.revoke, signed by this peer's key) to the
        registry: (stored, the registry's reason when not)."""
        reply = self._call("Revoke", {"run_id": self.run_id, "token": revocations.token})
        if not isinstance(reply, dict):
            return False, "a malformed reply"
        return bool(reply.get("ok")), str(reply.get("reason", ""))

    def revoked(self, owners: Iterable[bytes]) -> frozenset[str]:
        """Fingerprints of the learner keys the run owners `owners` revoked: each owner's newest list
        whose signature holds here again (the registry is not trusted with the owner's authority)."""
        owners = [key for key in map(_canonical_or_none, owners) if key is not None]
        reply = self._call("Revocations", {"run_id": self.run_id, "owners": owners})
        tokens = reply.get("revocations") if isinstance(reply, dict) else None
        newest: dict[bytes, Revocations] = {}
        for token in tokens if isinstance(tokens, list) else []:
            try:
                found = parse_revocations(token)
            except (CertificateError, TypeError):
                continue
            if found.owner in owners and found.run_id == self.run_id and \
                    (found.owner not in newest or found.issued > newest[found.owner].issued):
                newest[found.owner] = found
        return frozenset(k for found in newest.values() for k in found.revoked)

    def rollout_inbox(self, **options):
        return GrpcRolloutInbox(self.server, **options)

    def rollout_sender(self, **options):
        return GrpcRolloutSender(self.channels, self.signer, **options)

    def weight_server(self, store):
        return GrpcWeightServer(self.server, store, slots=self.upload_slots)

    def weight_client(self, **options):
        return GrpcWeightClient(self.channels, self.signer, **options)

    def unreachable_errors(self) -> tuple[type[BaseException], ...]:
        return (grpc.RpcError, ConnectionError, TimeoutError, OSError, StopIteration)

    def shutdown(self) -> None:
        self.pusher.close()
        if self.server is not None:
            self.server.stop()
        self.channels.close()
