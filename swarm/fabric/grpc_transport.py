"""The swarm fabric over gRPC, for networks where libp2p cannot run: the same interfaces as
hivemind_transport.HivemindFabric.

- A **registry** (run by `swarm bootstrap --transport grpc`) holds membership records and version
  announcements in memory, with the same expiry as the DHT records. Each record is keyed by the
  peer's address and guarded by a per-peer token issued on its first heartbeat, so no peer can
  overwrite another's record until it has expired. Version announcements are signed with the
  learner's RSA key (the same key and `--learner-key` token as over hivemind): the registry refuses
  bad signatures, and samplers verify them again against the keys they were given.
- Every peer runs a gRPC **server** at `host:port` (its peer id here) serving its rollout inbox
  (learners) and the versions it holds (everyone: relay); peers stream rollouts and weights to
  each other directly.

No protobuf code generation: methods are registered as generic handlers carrying msgpack bytes
(frames from wire.py for rollouts, weight_delta payloads for weights, cut into chunks).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import msgpack

logger = logging.getLogger(__name__)

SERVICE = "gepo_swarm.v1"
CHUNK_BYTES = 4 * 1024 * 1024  # weight payloads travel in chunks well under gRPC's message limits
MESSAGE_LIMIT = 64 * 1024 * 1024
REGISTRY_REQUEST_LIMIT = 1024 * 1024
PEER_HEADER = "x-swarm-peer"  # the sender's claimed address (gRPC has no peer authentication)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes):
    return msgpack.unpackb(data, raw=False)


def _options(limit: int = MESSAGE_LIMIT) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


def _new_server(workers: int = 64, limit: int = MESSAGE_LIMIT):
    # one thread per open call: a learner's rollout streams block while its queue is full
    # (backpressure), so the pool must stay larger than the number of samplers streaming at once
    import grpc

    return grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"), options=_options(limit))


def _bind(server, host: str, port: int) -> int:
    bound = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    if not bound:
        raise OSError(f"could not listen on {host}:{port}; is the port in use?")
    return bound


# ---------------------------------------------------------------------------------------------
# registry


@dataclass
class _Entry:
    value: dict
    expires_at: float
    token: str = ""
    signature: bytes = b""
    payload: bytes = b""


class Registry:
    """Membership records and version announcements per run, in memory, with expiry."""

    def __init__(self, *, max_expiry_s: float = 3600.0, clock=time.time) -> None:
        self.max_expiry_s, self.clock = max_expiry_s, clock
        self.members: dict[str, dict[str, _Entry]] = {}
        self.versions: dict[str, dict[bytes, _Entry]] = {}
        self.lock = threading.Lock()

    def _live(self, table: dict) -> dict:
        now = self.clock()
        for key in [k for k, e in table.items() if e.expires_at <= now]:
            del table[key]
        return table

    def heartbeat(self, request: dict, context=None) -> dict:
        from swarm.fabric.records import MemberRecord

        try:
            run_id, peer_id, token = str(request["run_id"]), str(request["peer_id"]), request.get("token") or ""
            record = MemberRecord.parse_obj(request["record"])
            expiry = min(float(request["expiry_s"]), self.max_expiry_s)
        except Exception as exc:  # noqa: BLE001  anything malformed is refused with the reason
            return {"ok": False, "reason": f"malformed record: {exc}"}
        if record.peer_id != peer_id:
            return {"ok": False, "reason": "a record must carry its own peer's id"}
        with self.lock:
            table = self._live(self.members.setdefault(run_id, {}))
            held = table.get(peer_id)
            if held is not None and not secrets.compare_digest(held.token, token):
                return {"ok": False, "reason": f"the record of {peer_id} belongs to another peer (wrong token)"}
            token = held.token if held is not None else secrets.token_hex(16)
            table[peer_id] = _Entry(record.dict(), self.clock() + expiry, token)
        return {"ok": True, "token": token}

    def list_members(self, request: dict, context=None) -> dict:
        with self.lock:
            table = self._live(self.members.get(str(request.get("run_id")), {}))
            return {"members": [{"record": e.value, "expires_at": e.expires_at} for e in table.values()]}

    def announce(self, request: dict, context=None) -> dict:
        from swarm.fabric.records import VersionAnnouncement

        try:
            run_id, owner, payload, signature = str(request["run_id"]), bytes(request["owner"]), bytes(request["payload"]), bytes(request["signature"])
            announcement = VersionAnnouncement.parse_obj(unpack(payload))
            expiry = min(float(request.get("expiry_s", 60.0)), self.max_expiry_s)
        except Exception as exc:  # noqa: BLE001
            return {"ok": False, "reason": f"malformed announcement: {exc}"}
        if not verify_owner_signature(owner, payload, signature):
            return {"ok": False, "reason": "the announcement is not signed by the key it names"}
        with self.lock:
            table = self._live(self.versions.setdefault(run_id, {}))
            held = table.get(owner)
            if held is not None and held.value["version"] > announcement.version:
                return {"ok": False, "reason": f"version {announcement.version} is older than announced {held.value['version']}"}
            table[owner] = _Entry(announcement.dict(), self.clock() + expiry, signature=signature, payload=payload)
        return {"ok": True}

    def list_versions(self, request: dict, context=None) -> dict:
        with self.lock:
            table = self._live(self.versions.get(str(request.get("run_id")), {}))
            return {"versions": [{"owner": k, "payload": e.payload, "signature": e.signature} for k, e in table.items()]}

    def counts(self, run_id: str) -> dict:
        with self.lock:
            table = self._live(self.members.get(run_id, {}))
            return {r: sum(e.value["role"] == r for e in table.values()) for r in ("learner", "sampler")}


def serve_registry(registry: Registry, host: str = "127.0.0.1", port: int = 0):
    """(started gRPC server, bound port)."""
    import grpc

    handlers = {
        name: grpc.unary_unary_rpc_method_handler(fn, request_deserializer=unpack, response_serializer=pack)
        for name, fn in (("Heartbeat", registry.heartbeat), ("Members", registry.list_members),
                         ("Announce", registry.announce), ("Versions", registry.list_versions))
    }
    server = _new_server(limit=REGISTRY_REQUEST_LIMIT)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(f"{SERVICE}.Registry", handlers)])
    bound = _bind(server, host, port)
    server.start()
    return server, bound


def owner_key(private_key) -> bytes:
    """The `[owner:ssh-rsa ...]` form of a signing key's public half (as hivemind writes it)."""
    return b"[owner:" + private_key.get_public_key().to_bytes() + b"]"


def verify_owner_signature(owner: bytes, payload: bytes, signature: bytes) -> bool:
    from hivemind.utils.crypto import RSAPublicKey

    if not (owner.startswith(b"[owner:") and owner.endswith(b"]")):
        return False
    try:
        return RSAPublicKey.from_bytes(owner[len(b"[owner:"):-1]).verify(payload, signature)
    except Exception:  # noqa: BLE001  a key that does not parse verifies nothing
        return False
