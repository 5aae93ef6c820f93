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
the receiver knows the sender by its key, never by the address it claims. What this does NOT
protect against: there is no TLS, so a man in the middle on the path reads everything, can drop or
delay calls, can rewrite the frames of a rollout stream after its signed opening (only the
opening is signed: frames are not), and can replay a captured request within the clock-skew window
if the receiver's replay memory has forgotten it (it is bounded, and lost on restart). Mutual TLS
with certificates bound to these keys would close that; it is not done.

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

from swarm.fabric.signing import MAX_CLOCK_SKEW_S, owner_key, verify_owner_signature

SERVICE = "gepo_swarm.v1"
CHUNK_BYTES = 4 * 1024 * 1024  # weight payloads travel in chunks well under gRPC's message limits
MESSAGE_LIMIT = 64 * 1024 * 1024
REGISTRY_REQUEST_LIMIT = 1024 * 1024
REQUEST_WAIT_S = 10.0  # longest a server thread waits for a call's (one, small) request message

# Request signatures (see RequestSigner): what travels in each call's metadata
OWNER_HEADER = "x-swarm-owner-bin"  # the signing key's `[owner:...]` bytes
SIGNATURE_HEADER = "x-swarm-signature-bin"
TIME_HEADER = "x-swarm-time"  # the sender's clock, seconds since the epoch
RUN_HEADER = "x-swarm-run-bin"
PEER_HEADER = "x-swarm-peer-bin"  # the peer id the sender claims (checked against its key)
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


def new_server(workers: int = 64, limit: int = MESSAGE_LIMIT):
    # one thread per open call, for as long as it is open: callers size the pool for what they let
    # peers hold open (a learner's rollout streams) plus a reserve for everything else
    # no SO_REUSEPORT (gRPC's default on Linux): a second server on a port in use must fail to
    # start, not share the port and receive half of the first one's calls
    return grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
                       options=channel_options(limit) + [("grpc.so_reuseport", 0)])


def bind(server, host: str, port: int) -> int:
    try:  # grpc returns 0 on a failed bind in older versions and raises RuntimeError in newer ones
        bound = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if not bound:
        raise OSError(f"could not listen on {host}:{port}; is the port in use?")
    return bound


def key_id(owner: bytes) -> str:
    """A short, stable name of a signing key (its `[owner:...]` bytes): 16 hex characters of their
    SHA-256. Taking another key's id means finding a second key with the same 64-bit prefix."""
    return hashlib.sha256(owner).hexdigest()[:16]


def peer_id_of(key: str, address: str) -> str:
    """A gRPC peer's id: its key id and the address it serves on (see the module docstring)."""
    return f"{key}@{address}"


def dial_address(peer: str) -> str:
    """Where to reach a peer: the address part of a peer id (`KEYID@host:port`), or `host:port`
    itself (the registry's address has no key id)."""
    return peer.partition("@")[2] if "@" in peer else peer


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


def _signed_bytes(method: str, run_id: str, stamp: str, peer: str, body: bytes) -> bytes:
    return pack([SIGNATURE_DOMAIN, method, run_id, stamp, peer, hashlib.sha256(body).digest()])


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
        stamp = f"{time.time() if now is None else now:.3f}"
        signature = self.key.sign(_signed_bytes(method, self.run_id, stamp, self.peer, body))
        return ((OWNER_HEADER, self.owner), (SIGNATURE_HEADER, signature), (TIME_HEADER, stamp),
                (RUN_HEADER, self.run_id.encode()), (PEER_HEADER, self.peer.encode()))


class Unauthenticated(Exception):
    """A request without a valid signature; the message says what is wrong with it."""


@dataclass(frozen=True)
class Caller:
    """Who made a request, as its signature proves: `key` (the key id) names the sender; `peer` is
    the peer id it claims (its key id is checked, the address in it is the sender's word);
    `ip` is where the call came from, as the server's socket saw it."""

    owner: bytes
    key: str
    peer: str
    run_id: str
    ip: str


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
        """The verified Caller, or Unauthenticated. `run_id`: the run this server serves (None: the
        run the request names, as a registry of several runs takes it)."""
        fields = _metadata_fields(metadata)
        owner, signature, stamp = fields.get(OWNER_HEADER), fields.get(SIGNATURE_HEADER), fields.get(TIME_HEADER)
        run, peer = fields.get(RUN_HEADER), fields.get(PEER_HEADER)
        if not (isinstance(owner, bytes) and isinstance(signature, bytes) and isinstance(stamp, str)
                and isinstance(run, bytes) and isinstance(peer, bytes)):
            raise Unauthenticated(f"unsigned request: sign it with the peer's key ({OWNER_HEADER}, {SIGNATURE_HEADER}, "
                                  f"{TIME_HEADER}, {RUN_HEADER}, {PEER_HEADER})")
        if len(owner) > MAX_OWNER_BYTES or len(signature) > MAX_SIGNATURE_BYTES or len(peer) > MAX_CLAIM_BYTES:
            raise Unauthenticated(f"oversized key ({len(owner)} bytes), signature or peer id ({len(peer)} bytes)")
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
        if not verify_owner_signature(owner, _signed_bytes(method, run_text, stamp, peer_text, body), signature):
            raise Unauthenticated(f"bad signature: the request to {method} is not signed by the key it names")
        key = key_id(owner)
        if peer_text != key and key_of_peer(peer_text) != key:
            raise Unauthenticated(f"the request claims peer id {peer_text!r}, which is not the signing key's ({key}@...)")
        self._remember(hashlib.sha256(signature).digest(), sent_at + self.skew_s, now)
        return Caller(owner=owner, key=key, peer=peer_text, run_id=run_text, ip=ip)

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


def authenticate(authenticator: Authenticator, context, method: str, body: bytes, run_id: str | None = None) -> Caller:
    """The verified caller of a server call; otherwise the call ends UNAUTHENTICATED with the reason
    (context.abort raises), before anything reads the request."""
    try:
        return authenticator.check(context.invocation_metadata(), method, body, ip=remote_ip(context.peer()), run_id=run_id)
    except Unauthenticated as exc:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        raise  # not reached: abort raises
