"""The registry of a gRPC swarm (`swarm bootstrap --transport grpc`): membership records and
version announcements per run, in memory, with expiry; see grpc/common.py for the transport.

Every call is signed by its sender's key (grpc.common.Authenticator) and every record belongs to
the key that signed it: a peer has one membership record and one announcement per run, which only
its key can replace, so nobody can hold or overwrite another peer's record, and two peers that
claim the same address are still two records. What one remote IP and one run may hold is bounded
(`max_per_ip`, `max_per_run`, `max_runs`: a refusal names the limit), expiries are finite and
bounded, and a Members reply comes in pages that stay under the message limit.

Run slots belong to learners: a run holds one of the `max_runs` slots while one of its learners
has a live record or announcement in it, and only that learner's key renews them; one key takes
part in at most `max_runs_per_owner` runs (a key is one owner however its text is spelt). Records
of a run no learner holds yet (samplers that came first) wait in one of at most `max_runs`
waiting runs, which take no slot from a learner.

A run owner's revocation list (`swarm authorize --revoke --transport grpc`) is kept per run and
owner key, posted only by the key that signed it, a newer one replacing an older one; peers ask for
their owners' lists and check the signatures themselves (GrpcFabric.revoked).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from swarm.config import BootstrapConfig, default_of
from swarm.fabric.grpc.common import (REGISTRY_REQUEST_LIMIT, REQUEST_WAIT_S, SERVICE, Authenticator, Caller, Method, OwnerCalls,
    SignedService, Watchdog, bind, key_id, new_server, pack, signed_body, unpack)
from swarm.fabric.grpc.tls import INSECURE_WARNING, server_identity
from swarm.fabric.membership.addresses import announced_address, host_port, interface_addresses, is_wildcard
from swarm.fabric.membership.authority import MAX_CERTIFICATE_DAYS, CertificateError, parse_revocations
from swarm.fabric.membership.records import Member, MemberRecord
from swarm.fabric.signing import canonical_owner, owner_id, owner_key, verify_owner_signature
from swarm.fabric.weights.announcements import VersionAnnouncement

logger = logging.getLogger(__name__)

MAX_OWNERS_ASKED = 16  # learner keys one Versions request may name
PAGE_SIZE = 256  # entries per Members or Versions reply: 256 of the largest records stay well under 1 MiB
MAX_MEMBER_PAGES = 64  # pages a peer follows (64 x 256 > max_per_run's default)
REGISTRY_CALLS_PER_OWNER = 8  # registry calls one key holds open at once (a peer makes one or two at a time)
MAX_REVOCATION_LISTS = 64  # revocation lists one run holds (one per owner key; a run has one owner, a few at most)
MAX_REVOCATION_LISTS_PER_IP = 4  # of those, how many one remote IP may post: a flood from one address fills no run
REVOCATION_LIFE_S = MAX_CERTIFICATE_DAYS * 86400.0 + 3600.0  # a revocation outlives every certificate it takes back


@dataclass
class _Entry:
    value: dict
    expires_at: float
    ip: str
    owner: bytes = b""
    signature: bytes = b""
    payload: bytes = b""
    learner: bool = False  # a learner's record or announcement: it holds its run's slot


@dataclass
class _Table:
    """One run's records of one kind, keyed by their owner's key id, how many each remote IP holds,
    and when the learners' entries among them expire."""

    entries: dict = field(default_factory=dict)
    per_ip: Counter = field(default_factory=Counter)
    learners: dict = field(default_factory=dict)  # key id -> expiry of its learner entry

    def put(self, key, entry: _Entry) -> None:
        self.drop(key)
        self.entries[key] = entry
        self.per_ip[entry.ip] += 1
        if entry.learner:
            self.learners[key] = entry.expires_at

    def drop(self, key) -> None:
        old = self.entries.pop(key, None)
        self.learners.pop(key, None)
        if old is not None:
            self.per_ip[old.ip] -= 1
            if self.per_ip[old.ip] <= 0:
                del self.per_ip[old.ip]

    def held(self, now: float) -> bool:
        """Whether a learner's live entry holds the run's slot."""
        return any(expires > now for expires in self.learners.values())

    def has(self, key, now: float) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry.expires_at > now

    def prune(self, now: float) -> None:
        for key in [k for k, e in self.entries.items() if e.expires_at <= now]:
            self.drop(key)

    def live(self, now: float) -> dict:
        return {k: e for k, e in self.entries.items() if e.expires_at > now}


class Registry:
    """Membership records and version announcements per run, in memory, with expiry and quotas.

    max_per_ip: live records (of one kind, in one run) from one remote IP. A NAT puts a whole site
    behind one IP, hence the generous default; raise it for larger sites.
    max_per_run: live records of one kind in one run. max_runs: runs a learner holds (and, apart,
    runs waiting for their learner). max_runs_per_owner: runs one key has live records in.
    page_size: entries per Members (or unfiltered Versions) reply, at most PAGE_SIZE.
    """

    def __init__(self, *, max_expiry_s: float = 3600.0, max_per_ip: int = 64, max_per_run: int = 10_000, max_runs: int = 16,
                 max_runs_per_owner: int = default_of(BootstrapConfig, "max_runs_per_owner"), page_size: int = PAGE_SIZE,
                 clock=time.time) -> None:
        self.max_expiry_s, self.clock, self.page_size = max_expiry_s, clock, min(page_size, PAGE_SIZE)
        self.max_per_ip, self.max_per_run, self.max_runs = max_per_ip, max_per_run, max_runs
        self.max_runs_per_owner = max_runs_per_owner
        self.members: dict[str, _Table] = {}  # run -> records by key id
        self.versions: dict[str, _Table] = {}  # run -> announcements by their key's id
        self.revocations: dict[str, _Table] = {}  # run -> each owner key's newest revocation list, by key id
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

    def _refusal(self, tables: dict[str, _Table], run_id: str, key: str, ip: str, learner: bool) -> str | None:
        """Why a new record of `key` from `ip` in `run_id` would pass a quota (None: it would not);
        `learner`: it is a learner's (it holds the run's slot). Expired records are dropped first,
        so they never count. Called with the lock held."""
        now = self.clock()
        for table in (self.members.get(run_id), self.versions.get(run_id)):
            if table is not None:
                table.prune(now)
        runs = set(self.members) | set(self.versions)
        if run_id not in runs or (learner and not self._held(run_id, now)):
            _drop_ended_runs(self.members, now)
            _drop_ended_runs(self.versions, now)
            runs = set(self.members) | set(self.versions)
            held = {run for run in runs if self._held(run, now)}
            if learner and len(held) >= self.max_runs:
                return f"the registry holds {self.max_runs} runs with learners (max_runs); try again when one ends"
            if not learner and run_id not in runs and len(runs - held) >= self.max_runs:
                return (f"{self.max_runs} runs at this registry wait for their learner (max_runs); run {run_id!r} is "
                        "taken when its learner joins: start the learner first, or wait for it")
        mine = {run for run in runs if self._has(run, key, now)}
        if run_id not in mine and len(mine) >= self.max_runs_per_owner:
            return f"key {key} takes part in {len(mine)} runs here already (max_runs_per_owner: {self.max_runs_per_owner})"
        table = tables.get(run_id)
        if table is None:
            return None
        held = table.entries.get(key)
        if held is not None and held.ip == ip:
            return None  # a peer replacing its own record takes no more room
        if held is None and len(table.entries) >= self.max_per_run:
            return f"run {run_id!r} holds {self.max_per_run} records (max_per_run)"
        if table.per_ip[ip] >= self.max_per_ip:
            return f"{ip} holds {self.max_per_ip} records in run {run_id!r} (max_per_ip; a NAT shares one IP: the registry can allow more)"
        return None

    def _held(self, run_id: str, now: float) -> bool:
        return any(t is not None and t.held(now) for t in (self.members.get(run_id), self.versions.get(run_id)))

    def _has(self, run_id: str, key: str, now: float) -> bool:
        return any(t is not None and t.has(key, now) for t in (self.members.get(run_id), self.versions.get(run_id)))

    def heartbeat(self, request: dict, caller: Caller | None = None) -> dict:
        """Store the caller's membership record; the record names the caller's own peer id."""

        if caller is None:
            return {"ok": False, "reason": "an unsigned heartbeat: a record belongs to the key that signs it"}
        try:
            run_id = str(request["run_id"])
            record = MemberRecord.parse_obj(request["record"])
            expiry = self._expiry(request["expiry_s"])
        except Exception as exc:  # noqa: BLE001  anything malformed is refused with the reason
            return {"ok": False, "reason": f"malformed record: {exc}"}
        if record.peer_id != caller.peer:
            return {"ok": False, "reason": f"a record must carry its own peer's id: {record.peer_id!r} is not "
                                           f"{caller.peer!r}, the id the request is signed as"}
        learner = record.role == "learner"
        with self.lock:
            refused = self._refusal(self.members, run_id, caller.key, caller.ip, learner)
            if refused:
                return {"ok": False, "reason": refused}
            self.members.setdefault(run_id, _Table()).put(
                caller.key, _Entry(record.dict(), self.clock() + expiry, caller.ip, owner=caller.owner, learner=learner))
        return {"ok": True}

    def list_members(self, request: dict, caller: Caller | None = None) -> dict:
        """One page of the run's records, ordered by key id: those after `after` (the `next` of the
        previous page), at most `limit` (and page_size). `next` is None on the last page."""
        if not isinstance(request, dict):
            return {"members": [], "next": None}
        after, limit = request.get("after"), request.get("limit")
        limit = max(1, min(self.page_size, limit if isinstance(limit, int) else self.page_size))
        with self.lock:
            table = self.members.get(str(request.get("run_id")))
            live = table.live(self.clock()) if table else {}
        keys = sorted(k for k in live if not isinstance(after, str) or k > after)
        page = keys[:limit]
        return {"members": [{"owner": live[k].owner, "record": live[k].value, "expires_at": live[k].expires_at} for k in page],
                "next": page[-1] if len(keys) > limit else None}

    def announce(self, request: dict, caller: Caller | None = None) -> dict:
        """Store a learner's signed announcement, posted by that learner (a caller of None: a call
        from this process, posted by the announcement's own key)."""

        try:
            run_id = str(request["run_id"])
            owner, payload, signature = (_bytes(request, name) for name in ("owner", "payload", "signature"))
            announcement = VersionAnnouncement.parse_obj(unpack(payload))
            expiry = self._expiry(request.get("expiry_s", 60.0))
        except Exception as exc:  # noqa: BLE001
            return {"ok": False, "reason": f"malformed announcement: {exc}"}
        if announcement.run_id != run_id:
            return {"ok": False, "reason": f"the announcement is for run {announcement.run_id!r}, not {run_id!r}"}
        if not verify_owner_signature(owner, payload, signature):
            return {"ok": False, "reason": "the announcement is not signed by the key it names"}
        owner, key = canonical_owner(owner), owner_id(owner)  # one key, one announcement, however its text is spelt
        if caller is not None and owner != caller.owner:  # nobody re-posts a learner's announcement (after it expired, say)
            return {"ok": False, "reason": "an announcement is posted by the key that signed it"}
        ip = caller.ip if caller is not None else "local"
        with self.lock:
            refused = self._refusal(self.versions, run_id, key, ip, learner=True)
            if refused:
                return {"ok": False, "reason": refused}
            table = self.versions.setdefault(run_id, _Table())
            held = table.entries.get(key)
            if held is not None and held.value["version"] > announcement.version:
                return {"ok": False, "reason": f"version {announcement.version} is older than announced {held.value['version']}"}
            table.put(key, _Entry(announcement.dict(), self.clock() + expiry, ip, owner=owner, signature=signature,
                                  payload=payload, learner=True))
        return {"ok": True}

    def list_versions(self, request: dict, caller: Caller | None = None) -> dict:
        """The run's announcements; only those of `owners` when the request names them (a sampler
        names its learner keys, so announcements under other keys cannot swell its reply), else
        the first page_size."""
        if not isinstance(request, dict):
            return {"versions": []}
        owners = request.get("owners")
        wanted = {_key_id_or_none(o) for o in owners[:MAX_OWNERS_ASKED]} if isinstance(owners, list) else None
        with self.lock:
            table = self.versions.get(str(request.get("run_id")))
            live = table.live(self.clock()) if table else {}
        found = [{"owner": e.owner, "payload": e.payload, "signature": e.signature} for k, e in live.items()
                 if wanted is None or k in wanted]
        return {"versions": found[:self.page_size]}

    def revoke(self, request: dict, caller: Caller | None = None) -> dict:
        """Store the caller's revocation list for the run (authority.revoke): signed by the key that
        posts it and naming that key as its owner, so only a run owner's own key can publish the
        list samplers and learners read under it. A newer list replaces an older one; an older one
        is refused. Only a run the registry knows (a learner or sampler is in it) takes lists, at
        most MAX_REVOCATION_LISTS of them, MAX_REVOCATION_LISTS_PER_IP from one IP."""
        if caller is None:
            return {"ok": False, "reason": "an unsigned revocation list: only the run owner's key may publish one"}
        run_id, token = str(request.get("run_id")), request.get("token")
        try:
            revocations = parse_revocations(token)  # bounded: MAX_REVOCATION_CHARS, MAX_REVOKED keys
        except CertificateError as exc:
            return {"ok": False, "reason": str(exc)}
        if revocations.run_id != run_id:
            return {"ok": False, "reason": f"the revocation list is for run {revocations.run_id!r}, not {run_id!r}"}
        if revocations.owner != caller.owner:
            return {"ok": False, "reason": "a revocation list is published by the owner key that signed it"}
        now = self.clock()
        with self.lock:
            if run_id not in set(self.members) | set(self.versions):
                return {"ok": False, "reason": f"run {run_id!r} has no learner or sampler at this registry; publish the "
                                               "list once the run is up"}
            if run_id not in self.revocations and len(self.revocations) >= 2 * self.max_runs:
                for ended in [r for r in self.revocations if r not in set(self.members) | set(self.versions)]:
                    del self.revocations[ended]  # a run nobody is in any more: its owner publishes again
                if len(self.revocations) >= 2 * self.max_runs:
                    return {"ok": False, "reason": f"the registry holds revocation lists of {2 * self.max_runs} live runs"}
            table = self.revocations.setdefault(run_id, _Table())
            table.prune(now)
            held = table.entries.get(caller.key)
            if held is not None and parse_revocations(held.value["token"]).issued >= revocations.issued:
                return {"ok": False, "reason": "a revocation list as new or newer is held; publish the newest one "
                                               "(`swarm authorize --revoke` keeps it beside the owner key)"}
            if held is None and len(table.entries) >= MAX_REVOCATION_LISTS:
                return {"ok": False, "reason": f"run {run_id!r} holds {MAX_REVOCATION_LISTS} revocation lists"}
            if (held is None or held.ip != caller.ip) and table.per_ip[caller.ip] >= MAX_REVOCATION_LISTS_PER_IP:
                return {"ok": False, "reason": f"{caller.ip} holds {MAX_REVOCATION_LISTS_PER_IP} revocation lists in run {run_id!r}"}
            table.put(caller.key, _Entry({"token": token}, now + REVOCATION_LIFE_S, caller.ip, owner=caller.owner))
        return {"ok": True}

    def list_revocations(self, request: dict, caller: Caller | None = None) -> dict:
        """The revocation lists of the owner keys the request names (at most MAX_OWNERS_ASKED)."""
        owners = request.get("owners") if isinstance(request, dict) else None
        if not isinstance(owners, list):
            return {"revocations": []}
        wanted = {_key_id_or_none(o) for o in owners[:MAX_OWNERS_ASKED]}
        with self.lock:
            table = self.revocations.get(str(request.get("run_id")))
            live = table.live(self.clock()) if table else {}
        return {"revocations": [e.value["token"] for k, e in live.items() if k in wanted]}

    def observe(self, request: dict, caller: Caller | None = None) -> dict:
        """The address the caller's call came from, as this registry's socket saw it: what a peer
        listening on every interface tells others to dial (behind a NAT: the NAT's public address)."""
        if caller is None:
            return {"ok": False, "reason": "an unsigned request"}
        return {"ok": True, "ip": caller.ip}

    def all_members(self, run_id: str) -> list[dict]:
        """Every page of the run's records (the registry's own view: no message limit applies)."""
        listed, after = [], None
        while True:
            page = self.list_members({"run_id": run_id, "after": after})
            listed += page["members"]
            after = page["next"]
            if after is None:
                return listed

    def counts(self, run_id: str) -> dict:
        records = [m["record"] for m in self.all_members(run_id)]
        return {r: sum(m["role"] == r for m in records) for r in ("learner", "sampler")}


def _drop_ended_runs(tables: dict[str, _Table], now: float) -> None:
    """Forget the runs whose records have all expired (so they count no more against max_runs)."""
    for run, table in list(tables.items()):
        table.prune(now)
        if not table.entries:
            del tables[run]


def _key_id_or_none(owner) -> str | None:
    """The key id of an `[owner:...]` subkey a request names; None when it names no key."""
    try:
        return owner_id(owner) if isinstance(owner, bytes) else None
    except ValueError:
        return None


def _bytes(request: dict, name: str) -> bytes:
    """A bytes field of a request; anything else is refused, never converted (bytes(2**34) would
    allocate 16 GiB on the word of a 9-byte request)."""
    value = request[name]
    if not isinstance(value, bytes):
        raise ValueError(f"{name} must be bytes, not {type(value).__name__}")
    return value


class _RegistryService:
    """The registry's gRPC methods: each call's signature is checked before it gets a thread
    (grpc.common.SignedService); then its one request is read (the watchdog cuts a caller that
    never sends it), checked against the signed hash, and only then parsed."""

    METHODS = ("Heartbeat", "Members", "Announce", "Versions", "Observe", "Revoke", "Revocations")

    def __init__(self, registry: Registry, request_wait_s: float) -> None:
        self.registry, self.request_wait_s, self.watchdog = registry, request_wait_s, Watchdog()
        self.calls = {"Heartbeat": registry.heartbeat, "Members": registry.list_members,
                      "Announce": registry.announce, "Versions": registry.list_versions, "Observe": registry.observe,
                      "Revoke": registry.revoke, "Revocations": registry.list_revocations}

    def handler(self, method: str):
        def handle(requests, context, caller: Caller) -> dict:
            watch = self.watchdog.watch(context)
            try:
                body = signed_body(requests, watch, context, caller, REGISTRY_REQUEST_LIMIT, self.request_wait_s)
            finally:
                watch.close()
            try:
                request = unpack(body)
            except Exception as exc:  # noqa: BLE001  msgpack raises several types on garbage
                return {"ok": False, "reason": f"unreadable request: {type(exc).__name__}"}
            if not isinstance(request, dict) or request.get("run_id") != caller.run_id:
                return {"ok": False, "reason": f"a request is a map naming the run it is signed for ({caller.run_id!r})"}
            return self.calls[method](request, caller)

        return handle


def serve_registry(registry: Registry, host: str = "127.0.0.1", port: int = 0, *, signing_key=None, insecure: bool = False,
                   authenticator: Authenticator | None = None, request_wait_s: float = REQUEST_WAIT_S,
                   calls_per_owner: int = REGISTRY_CALLS_PER_OWNER, workers: int = 64):
    """(started gRPC server, bound port). Stop it with `stop_registry`. signing_key: the registry's
    key, whose certificate it presents over TLS (its id goes before the address peers are given:
    KEYID@host:port); insecure: plain text instead, with a warning. request_wait_s: how long a
    signed call may keep a server thread waiting for its request."""
    if signing_key is None and not insecure:
        raise ValueError("a gRPC registry needs a signing key for TLS, or insecure=True for plain text")
    if insecure:
        logger.warning(INSECURE_WARNING)
    service = _RegistryService(registry, request_wait_s)
    methods = {name: Method(service.handler(name), streams_replies=False, response_serializer=pack) for name in service.METHODS}
    server = new_server(workers=workers, limit=REGISTRY_REQUEST_LIMIT)
    server.add_generic_rpc_handlers([SignedService(f"{SERVICE}.Registry", methods, authenticator or Authenticator(),
                                                   calls=OwnerCalls(calls_per_owner))])
    server.watchdog = service.watchdog
    bound = bind(server, host, port, None if insecure else server_identity(signing_key))
    server.start()
    return server, bound


def stop_registry(server) -> None:
    server.stop(grace=1.0).wait(5)
    server.watchdog.close()


def members_from(listed: list[dict]) -> list:
    """Members of a registry's listing (its own, or Members replies), sorted by role and peer id;
    each one's owner is the key that signed its record. An entry that does not parse is skipped."""

    found = []
    for item in listed:
        try:
            record = MemberRecord.parse_obj(item["record"])
            if record.leaving:  # gone, though its record has not expired yet
                continue
            found.append(Member(record=record, expires_at=float(item["expires_at"]), owner=_bytes(item, "owner")))
        except Exception:  # noqa: BLE001  a malformed entry from a registry is not ours to crash on
            continue
    return sorted(found, key=lambda m: (m.record.role, m.record.peer_id))


class GrpcBootstrap:
    """A bootstrap node of a gRPC swarm: the registry, served on `host:port` (over TLS with
    `signing_key`'s certificate, a fresh key when None, unless `insecure`)."""

    transport = "grpc"

    def __init__(self, run_id: str, *, host: str, port: int, announce_addr: str | None = None, signing_key=None,
                 insecure: bool = False, max_runs_per_owner: int = default_of(BootstrapConfig, "max_runs_per_owner")) -> None:
        from hivemind.utils.crypto import RSAPrivateKey

        self.run_id, self.host, self.insecure = run_id, host, insecure
        self.signing_key = signing_key or RSAPrivateKey()
        self.key_id = "" if insecure else key_id(owner_key(self.signing_key))
        self.registry = Registry(max_runs_per_owner=max_runs_per_owner)
        self._server, self.port = serve_registry(self.registry, host, port, signing_key=self.signing_key, insecure=insecure)
        self.announced = announced_address(announce_addr, self.port) if announce_addr else None

    @property
    def peer_id(self) -> str:
        return self.addresses()[0]

    def addresses(self) -> list[str]:
        """KEYID@HOST:PORT for --peers (HOST:PORT when insecure), the best for others first: the
        announced address, else (listening on every interface) this machine's addresses, public,
        private, then loopback. The key id pins the registry's TLS certificate (grpc/tls.py)."""

        hosts = interface_addresses() if is_wildcard(self.host) else [self.host]
        found = [host_port(h, self.port) for h in hosts]
        prefix = f"{self.key_id}@" if self.key_id else ""
        return [prefix + a for a in dict.fromkeys(([self.announced] if self.announced else []) + found)]

    def members(self):
        return members_from(self.registry.all_members(self.run_id))

    def shutdown(self) -> None:
        stop_registry(self._server)
