"""The registry of a gRPC swarm (`swarm bootstrap --transport grpc`): membership records and
version announcements per run, in memory, with expiry; see grpc_common.py for the transport."""

from __future__ import annotations

import math
import secrets
import threading
import time
from dataclasses import dataclass

from swarm.fabric.grpc_common import REGISTRY_REQUEST_LIMIT, SERVICE, bind, new_server, pack, unpack, verify_owner_signature

MAX_OWNERS_ASKED = 16  # learner keys one Versions request may name



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

    def _expiry(self, value) -> float:
        """Seconds a record lives: finite and positive (a NaN expiry would never pass), at most max_expiry_s."""
        try:
            expiry = float(value)
        except (TypeError, ValueError):
            expiry = math.nan
        if not math.isfinite(expiry) or expiry <= 0:
            raise ValueError(f"expiry {value!r} must be a finite number of seconds > 0")
        return min(expiry, self.max_expiry_s)

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
            expiry = self._expiry(request["expiry_s"])
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
            expiry = self._expiry(request.get("expiry_s", 60.0))
        except Exception as exc:  # noqa: BLE001
            return {"ok": False, "reason": f"malformed announcement: {exc}"}
        if announcement.run_id != run_id:
            return {"ok": False, "reason": f"the announcement is for run {announcement.run_id!r}, not {run_id!r}"}
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
        """The run's announcements; only those of `owners` when the request names them (a sampler
        names its learner keys, so announcements under other keys cannot swell its reply)."""
        owners = request.get("owners")
        wanted = {bytes(o) for o in owners[:MAX_OWNERS_ASKED] if isinstance(o, bytes)} if isinstance(owners, list) else None
        with self.lock:
            table = self._live(self.versions.get(str(request.get("run_id")), {}))
            return {"versions": [{"owner": k, "payload": e.payload, "signature": e.signature} for k, e in table.items()
                                 if wanted is None or k in wanted]}

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
    server = new_server(limit=REGISTRY_REQUEST_LIMIT)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(f"{SERVICE}.Registry", handlers)])
    bound = bind(server, host, port)
    server.start()
    return server, bound


def members_from(listed: list[dict]) -> list:
    """Members of a registry's listing (its own, or a Members reply), sorted by role and peer id;
    an entry that does not parse is skipped."""
    from swarm.fabric.records import Member, MemberRecord

    found = []
    for item in listed:
        try:
            record = MemberRecord.parse_obj(item["record"])
            found.append(Member(record=record, expires_at=float(item["expires_at"]), owner=record.peer_id.encode()))
        except Exception:  # noqa: BLE001  a malformed entry from a registry is not ours to crash on
            continue
    return sorted(found, key=lambda m: (m.record.role, m.record.peer_id))


class GrpcBootstrap:
    """A bootstrap node of a gRPC swarm: the registry, served on `host:port`."""

    transport = "grpc"

    def __init__(self, run_id: str, *, host: str, port: int) -> None:
        self.run_id, self.host = run_id, host
        self.registry = Registry()
        self._server, self.port = serve_registry(self.registry, host, port)

    @property
    def peer_id(self) -> str:
        return self.addresses()[0]

    def addresses(self) -> list[str]:
        # a wildcard address is not something another peer can dial: show loopback, and the
        # operator substitutes the machine's address for peers elsewhere
        shown = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return [f"{shown}:{self.port}"]

    def members(self):
        return members_from(self.registry.list_members({"run_id": self.run_id})["members"])

    def shutdown(self) -> None:
        self._server.stop(grace=1.0).wait(5)
