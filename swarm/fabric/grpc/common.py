"""What both sides of the gRPC fallback transport share: msgpack framing, channel and server
options, signed requests, the watchdog that frees server threads from slow peers, and the
signed requests under the learner keys of signing.py (the same keys and `--learner-key` tokens as over hivemind).

The transport itself (see grpc/registry.py and grpc/fabric.py):
- a **registry** (run by `swarm bootstrap --transport grpc`) holds membership records and version
  announcements in memory, with the same expiry as the DHT records. Each record belongs to the key
  that signed the request carrying it (one record per key and run, as in the DHT), with quotas per
  remote IP and per run. Version announcements are signed with the learner's RSA key: the registry
  refuses bad signatures, and samplers verify them again against the keys they were given.
- every peer runs a gRPC **server** serving its rollout inbox (learners) and the versions it holds;
  rollouts stream from samplers to the learner and weights from the learner to samplers directly.
  A peer's id is `KEYID@host:port`: the id of its signing key (`key_id`), and the address others
  dial (give one they can reach). Like a libp2p address ending in /p2p/ID, it names both whom to
  expect and where to find them, so two peers behind different NATs with the same private address
  still have different ids, and no peer can take another's id without its key.

Every request a peer makes is signed with its key (`RequestSigner`, checked by `Authenticator`):
the receiver knows the sender by its key, never by the address it claims, and one key is one
sender however its text is spelt (signing.owner_id). The signature travels in the call's metadata
and covers the SHA-256 of the request body, so it is checked (`SignedService`) while gRPC looks
the method up, before the call is given a server thread: an unsigned or forged call costs the
server a signature check (in gRPC's own polling thread) and a worker thread only for the instant
its refusal takes. A signed call then has REQUEST_WAIT_S to send its
body (whose hash must match), each key may hold only `calls_per_owner` calls open at once, and a
server takes at most `workers + queue` calls (grpc's maximum_concurrent_rpcs: RESOURCE_EXHAUSTED
beyond). Servers speak TLS with certificates pinned by key id (grpc/tls.py) unless `--insecure`.
What this does NOT protect against: a peer that makes many keys gets a share per key (making a
key costs it an RSA key generation); a man in the middle can still drop or delay calls (TLS keeps
it from reading, rewriting or replaying them).

No protobuf code generation: methods are registered as generic handlers carrying msgpack bytes
(frames from wire.py for rollouts, weights.delta payloads for weights, cut into chunks). Every method
streams its requests, even those that carry one message: a unary gRPC handler waits for its
request inside its server thread, where no deadline of ours can reach a peer that never sends it.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import OrderedDict
from concurrent import futures
from dataclasses import dataclass

import grpc
import msgpack

from swarm.fabric.signing import MAX_CLOCK_SKEW_S, canonical_owner, owner_id, owner_key, signature_digest, verify_owner_signature

SERVICE = "gepo_swarm.v1"
CHUNK_BYTES = 4 * 1024 * 1024  # weight payloads travel in chunks well under gRPC's message limits
MESSAGE_LIMIT = 64 * 1024 * 1024
REGISTRY_REQUEST_LIMIT = 1024 * 1024
REQUEST_WAIT_S = 3.0  # longest a server thread waits for a signed call's (one, small) request message
CALLS_PER_OWNER = 16  # calls one key may hold open at one server (a peer's rollout streams count within their own limit too)

# Request signatures (see RequestSigner): what travels in each call's metadata
OWNER_HEADER = "x-swarm-owner-bin"  # the signing key's `[owner:...]` bytes
SIGNATURE_HEADER = "x-swarm-signature-bin"
TIME_HEADER = "x-swarm-time"  # the sender's clock, seconds since the epoch
RUN_HEADER = "x-swarm-run-bin"
PEER_HEADER = "x-swarm-peer-bin"  # the peer id the sender claims (checked against its key)
BODY_HEADER = "x-swarm-body-bin"  # SHA-256 of the request body (of b"" for a stream's opening), which the signature covers
SIGNATURE_DOMAIN = b"gepo-swarm/grpc-request/v1"  # a request signature is never valid as another signature
MAX_OWNER_BYTES = 1024  # a 4096-bit key's `[owner:ssh-rsa ...]` is ~730 bytes
MAX_SIGNATURE_BYTES = 1024
MAX_CLAIM_BYTES = 128  # a peer id (MemberRecord.peer_id allows 128 characters)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes):
    return msgpack.unpackb(data, raw=False)


def channel_options(limit: int = MESSAGE_LIMIT) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


def new_server(workers: int = 64, limit: int = MESSAGE_LIMIT, queue: int | None = None):
    """A gRPC server with `workers` threads that takes at most `workers + queue` calls at once
    (default queue: half the threads); past that a call is refused RESOURCE_EXHAUSTED at once,
    rather than waiting in an unbounded queue for a thread."""
    # one thread per open call, for as long as it is open: callers size the pool for what they let
    # peers hold open (a learner's rollout streams) plus a reserve for everything else
    # no SO_REUSEPORT (gRPC's default on Linux): a second server on a port in use must fail to
    # start, not share the port and receive half of the first one's calls
    queue = workers // 2 if queue is None else queue
    return grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
                       options=channel_options(limit) + [("grpc.so_reuseport", 0)], maximum_concurrent_rpcs=workers + queue)


def bind(server, host: str, port: int, identity=None) -> int:
    """Listen on host:port; with TLS when `identity` (a tls.ServerIdentity) is given, else in plain text."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:  # grpc returns 0 on a failed bind in older versions and raises RuntimeError in newer ones
        bound = server.add_secure_port(address, identity.credentials()) if identity else server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if not bound:
        raise OSError(f"could not listen on {host}:{port}; is the port in use?")
    return bound


def key_id(owner: bytes) -> str:
    """A short, stable name of a signing key (given as its `[owner:...]` bytes, however spelt): see
    signing.owner_id. Raises ValueError for bytes that name no acceptable key."""
    return owner_id(owner)


def peer_id_of(key: str, address: str) -> str:
    """A gRPC peer's id: its key id and the address it serves on (see the module docstring)."""
    return f"{key}@{address}"


def key_of_peer(peer: str) -> str:
    """The key id a peer id names ("" for a bare address)."""
    return peer.partition("@")[0] if "@" in peer else ""


def remote_ip(context_peer: str) -> str:
    """The IP of a gRPC caller (`ipv4:1.2.3.4:5678`, `ipv6:[::1]:5678`); the whole string otherwise
    (a Unix socket)."""
    kind, _, rest = (context_peer or "").partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    return context_peer or "?"


def _signed_bytes(method: str, run_id: str, stamp: str, peer: str, body_digest: bytes) -> bytes:
    return pack([SIGNATURE_DOMAIN, method, run_id, stamp, peer, body_digest])


@dataclass(frozen=True)
class RequestSigner:
    """Signs this peer's requests with its key. The signature covers the method (a Members request
    cannot be replayed as a Heartbeat), the run (nor in another run), the sender's clock (nor after
    MAX_CLOCK_SKEW_S), the peer id it claims, and the SHA-256 of the request body; a rollout stream
    signs its opening with an empty body (its frames are checked one by one, and not signed)."""

    key: object  # hivemind RSAPrivateKey
    run_id: str
    peer: str  # the peer id this sender claims; must start with its key id

    @property
    def owner(self) -> bytes:
        return owner_key(self.key)

    def metadata(self, method: str, body: bytes = b"", now: float | None = None) -> tuple:
        stamp, digest = f"{time.time() if now is None else now:.3f}", hashlib.sha256(body).digest()
        signature = self.key.sign(_signed_bytes(method, self.run_id, stamp, self.peer, digest))
        return ((OWNER_HEADER, self.owner), (SIGNATURE_HEADER, signature), (TIME_HEADER, stamp),
                (RUN_HEADER, self.run_id.encode()), (PEER_HEADER, self.peer.encode()), (BODY_HEADER, digest))


class Unauthenticated(Exception):
    """A request without a valid signature; the message says what is wrong with it."""


@dataclass(frozen=True)
class Caller:
    """Who made a request, as its signature proves: `key` (the key id) names the sender; `peer` is
    the peer id it claims (its key id is checked, the address in it is the sender's word);
    `ip` is where the call came from, as the server's socket saw it; `owner` is the key's one
    canonical text; `body_digest` the SHA-256 of the request body the signature covers."""

    owner: bytes
    key: str
    peer: str
    run_id: str
    ip: str
    body_digest: bytes = b""


class Authenticator:
    """Checks the signature of each request (see RequestSigner) before anything reads it, and
    remembers the signatures it has seen for as long as their timestamps are valid, so a request
    captured on the way is refused when sent again (the memory is bounded: `remember` signatures,
    the oldest forgotten first)."""

    def __init__(self, *, skew_s: float = MAX_CLOCK_SKEW_S, remember: int = 100_000, clock=time.time) -> None:
        self.skew_s, self.remember, self.clock = skew_s, remember, clock
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # signature digest -> when it may be forgotten
        self._lock = threading.Lock()

    def check(self, metadata, method: str, body: bytes, *, ip: str, run_id: str | None = None) -> Caller:
        """The verified Caller of a request whose body is at hand, or Unauthenticated. `run_id`: the
        run this server serves (None: the run the request names, as a registry of several runs takes it)."""
        caller = self.verify(metadata, method, ip=ip, run_id=run_id)
        check_body(caller, body)
        return caller

    def verify(self, metadata, method: str, *, ip: str = "", run_id: str | None = None) -> Caller:
        """The Caller the metadata's signature proves (its body not yet read: check_body checks it
        when it comes), or Unauthenticated. Cheap enough to run before a call is given a thread."""
        fields = _metadata_fields(metadata)
        owner, signature, stamp = fields.get(OWNER_HEADER), fields.get(SIGNATURE_HEADER), fields.get(TIME_HEADER)
        run, peer, digest = fields.get(RUN_HEADER), fields.get(PEER_HEADER), fields.get(BODY_HEADER)
        if not (isinstance(owner, bytes) and isinstance(signature, bytes) and isinstance(stamp, str)
                and isinstance(run, bytes) and isinstance(peer, bytes) and isinstance(digest, bytes)):
            raise Unauthenticated(f"unsigned request: sign it with the peer's key ({OWNER_HEADER}, {SIGNATURE_HEADER}, "
                                  f"{TIME_HEADER}, {RUN_HEADER}, {PEER_HEADER}, {BODY_HEADER})")
        if len(owner) > MAX_OWNER_BYTES or len(signature) > MAX_SIGNATURE_BYTES or len(peer) > MAX_CLAIM_BYTES:
            raise Unauthenticated(f"oversized key ({len(owner)} bytes), signature or peer id ({len(peer)} bytes)")
        if len(digest) != hashlib.sha256().digest_size:
            raise Unauthenticated(f"{BODY_HEADER} is {len(digest)} bytes; a SHA-256 is 32")
        try:
            run_text, peer_text, sent_at = run.decode(), peer.decode(), float(stamp)
        except (UnicodeDecodeError, ValueError):
            raise Unauthenticated("unreadable run id, peer id or timestamp") from None
        if run_id is not None and run_text != run_id:
            raise Unauthenticated(f"the request is signed for run {run_text!r}; this peer serves run {run_id!r}")
        now = self.clock()
        if not math.isfinite(sent_at) or abs(now - sent_at) > self.skew_s:
            raise Unauthenticated(f"the request's timestamp is {sent_at - now:+.0f}s off this server's clock (at most "
                                  f"{self.skew_s:.0f}s either way; check the clock of the sender)")
        if not verify_owner_signature(owner, _signed_bytes(method, run_text, stamp, peer_text, digest), signature):
            raise Unauthenticated(f"bad signature: the request to {method} is not signed by the key it names")
        key = key_id(owner)
        if peer_text != key and key_of_peer(peer_text) != key:
            raise Unauthenticated(f"the request claims peer id {peer_text!r}, which is not the signing key's ({key}@...)")
        try:
            remembered = signature_digest(signature)
        except ValueError as exc:
            raise Unauthenticated(str(exc)) from None
        self._remember(remembered, sent_at + self.skew_s, now)
        return Caller(owner=canonical_owner(owner), key=key, peer=peer_text, run_id=run_text, ip=ip, body_digest=digest)

    def _remember(self, digest: bytes, forget_at: float, now: float) -> None:
        with self._lock:
            if digest in self._seen:
                raise Unauthenticated("replayed request: this signature was used already")
            self._seen[digest] = forget_at
            while self._seen and (len(self._seen) > self.remember or next(iter(self._seen.values())) < now):
                self._seen.popitem(last=False)


def _metadata_fields(metadata) -> dict:
    """Metadata as a dict; a key sent twice counts as not sent (no guessing which one was signed)."""
    fields, repeated = {}, set()
    for key, value in metadata or ():
        if key in fields:
            repeated.add(key)
        fields[key] = value
    return {k: v for k, v in fields.items() if k not in repeated}


class Watch:
    """One call's deadline in a Watchdog: `expect(s)` while the server waits on the peer (its next
    message, or taking our last one), `hold()` while the server works; `cut` tells whether the
    watchdog cancelled the call."""

    def __init__(self, dog: "Watchdog", context) -> None:
        self._dog, self.context = dog, context
        self.deadline: float | None = None
        self.cut = False

    def expect(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def hold(self) -> None:
        self.deadline = None

    def close(self) -> None:
        self.deadline = None
        self._dog.forget(self)


class Watchdog:
    """Cancels the calls whose peer keeps a server thread waiting past its deadline, which wakes
    that thread (its read raises, its write returns) and so frees it. One thread per server: a
    timer thread per frame would cost more than the frame."""

    def __init__(self, tick_s: float = 0.05) -> None:
        self.tick_s = tick_s
        self._watches: set[Watch] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="grpc-watchdog", daemon=True)
        self._thread.start()

    def watch(self, context, seconds: float | None = None) -> Watch:
        watch = Watch(self, context)
        if seconds is not None:
            watch.expect(seconds)
        with self._lock:
            self._watches.add(watch)
        return watch

    def forget(self, watch: Watch) -> None:
        with self._lock:
            self._watches.discard(watch)

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            now = time.monotonic()
            with self._lock:
                late = [w for w in self._watches if w.deadline is not None and w.deadline <= now]
                self._watches.difference_update(late)
            for watch in late:
                watch.cut, watch.deadline = True, None
                watch.context.cancel()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def check_body(caller: Caller, body: bytes) -> None:
    """Unauthenticated unless `body` is the one the caller signed."""
    if hashlib.sha256(body).digest() != caller.body_digest:
        raise Unauthenticated("the request body is not the one signed (rewritten on the way, or signed wrongly)")


def first_request(requests, watch: Watch, limit: int, wait_s: float = REQUEST_WAIT_S) -> bytes:
    """The one request message of a call, waited for at most `wait_s` (the watchdog cuts a caller
    that never sends it) and at most `limit` bytes. Raises grpc.RpcError when the call is cut or
    cancelled, ValueError when nothing or too much came."""
    watch.expect(wait_s)
    try:
        body = next(requests)
    except StopIteration:
        raise ValueError("the call carried no request") from None
    finally:
        watch.hold()
    if len(body) > limit:
        raise ValueError(f"a request of {len(body)} bytes; at most {limit}")
    return body


def signed_body(requests, watch: Watch, context, caller: Caller, limit: int, wait_s: float = REQUEST_WAIT_S) -> bytes:
    """The one request of a signed call, which must be the body its signature covers; otherwise the
    call ends (INVALID_ARGUMENT or UNAUTHENTICATED, with the reason; context.abort raises)."""
    try:
        body = first_request(requests, watch, limit, wait_s)
        check_body(caller, body)
    except ValueError as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    except Unauthenticated as exc:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
    return body


class OwnerCalls:
    """How many calls each key holds open at one server, at most `limit` each."""

    def __init__(self, limit: int = CALLS_PER_OWNER) -> None:
        self.limit = limit
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, key: str) -> bool:
        with self._lock:
            if self._open.get(key, 0) >= self.limit:
                return False
            self._open[key] = self._open.get(key, 0) + 1
            return True

    def release(self, key: str) -> None:
        with self._lock:
            left = self._open.get(key, 0) - 1
            if left > 0:
                self._open[key] = left
            else:
                self._open.pop(key, None)

    def held(self, key: str) -> int:
        with self._lock:
            return self._open.get(key, 0)


@dataclass(frozen=True)
class Method:
    """One method of a SignedService: `behaviour(requests, context, caller)`, which streams its
    requests and returns one response (`streams_replies=False`) or an iterator of them."""

    behaviour: object
    streams_replies: bool
    response_serializer: object = None


class SignedService(grpc.GenericRpcHandler):
    """The methods of one gRPC service, each call's signature checked while gRPC looks its method up
    (in the server's own polling thread, before the call is queued for a worker thread): a call
    that is unsigned, forged, stale, replayed or for another run is refused there, and costs a
    worker only the instant it takes to send the refusal. A verified call is refused
    RESOURCE_EXHAUSTED when its key already holds `calls.limit` calls open here."""

    def __init__(self, service: str, methods: dict[str, Method], authenticator: Authenticator, *,
                 run_id: str | None = None, calls: OwnerCalls | None = None) -> None:
        self.methods = {f"/{service}/{name}": method for name, method in methods.items()}
        self.authenticator, self.run_id, self.calls = authenticator, run_id, calls or OwnerCalls()

    def service(self, handler_call_details):
        path = handler_call_details.method
        method = self.methods.get(path)
        if method is None:
            return None
        try:
            caller = self.authenticator.verify(handler_call_details.invocation_metadata, path, run_id=self.run_id)
        except Unauthenticated as exc:
            return self._handler(method, _refusal(grpc.StatusCode.UNAUTHENTICATED, str(exc)))
        return self._handler(method, self._bound(method, caller))

    def _bound(self, method: Method, caller: Caller):
        calls = self.calls

        def behaviour(requests, context):
            if not calls.take(caller.key):
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"key {caller.key} holds {calls.limit} calls open here "
                                                                  "already (the most one key may); try again when one ends")
            released = threading.Lock()

            def release() -> None:
                if released.acquire(blocking=False):
                    calls.release(caller.key)

            if not context.add_callback(release):  # the call has ended already
                release()
            here = Caller(owner=caller.owner, key=caller.key, peer=caller.peer, run_id=caller.run_id,
                          ip=remote_ip(context.peer()), body_digest=caller.body_digest)
            return method.behaviour(requests, context, here)

        return behaviour

    @staticmethod
    def _handler(method: Method, behaviour):
        if method.streams_replies:
            return grpc.stream_stream_rpc_method_handler(behaviour, request_deserializer=None,
                                                         response_serializer=method.response_serializer)
        return grpc.stream_unary_rpc_method_handler(behaviour, request_deserializer=None,
                                                    response_serializer=method.response_serializer)


def _refusal(code, reason: str):
    def refuse(requests, context):
        context.abort(code, reason)

    return refuse
