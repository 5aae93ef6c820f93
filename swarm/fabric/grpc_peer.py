"""A peer of a gRPC swarm (see grpc_common.py): its own server for rollouts and weights, the
clients that reach other peers and the registry, and `GrpcFabric`, which implements the fabric
interface (interface.py) like `HivemindFabric` does.

Every request is signed with the peer's key, and servers know their callers by key: a learner
bans, counts and shares its queue per key (as over hivemind per libp2p id), so a sender that
claims another peer's address harms nobody but itself. The server's thread pool is sized for the
rollout streams the inbox allows (StreamLimits.total) plus a reserve, so weight requests are
served while every stream is held open, and the watchdog cuts a stream idle longer than
StreamLimits.idle_s, or a weight transfer whose receiver stops reading, which frees its thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Iterable, Iterator, Mapping, Sequence

from swarm.fabric.grpc_common import (
    CHUNK_BYTES,
    MESSAGE_LIMIT,
    SERVICE,
    Authenticator,
    Caller,
    RequestSigner,
    Watchdog,
    authenticate,
    bind,
    dial_address,
    first_request,
    key_id,
    new_server,
    owner_key,
    pack,
    peer_id_of,
    unpack,
    verify_owner_signature,
)
from swarm.fabric.announcement_push import PUSH_TIMEOUT_S, AnnouncementPusher
from swarm.fabric.announcements import Announced, newest_authorised
from swarm.fabric.grpc_registry import MAX_MEMBER_PAGES
from swarm.fabric.chunks import ChunkCutOff, ChunkSpec
from swarm.fabric.grpc_weights import WEIGHTS, GrpcWeightClient, GrpcWeightServer
from swarm.fabric.interface import JoinError
from swarm.fabric.records import EXPIRY_HEARTBEATS, Heartbeat, RunSampling
from swarm.fabric.rollout_exchange import InboxCore, StreamLimits
from swarm.fabric.versions import WEIGHT_REQUEST_LIMIT

logger = logging.getLogger(__name__)

ROLLOUTS = f"/{SERVICE}.Peer/Rollouts"
RESERVE_WORKERS = 16  # server threads rollout streams can never take: weight requests and refusals run there
WEIGHT_SEND_S = 30.0  # longest a receiver may take to read one chunk (4 MiB: at least ~140 KB/s)
REMEMBERED_NAMES = 100_000
MAX_CHANNELS = 256  # open channels to other peers (the registry's among them), least recently used closed first
# what a client accepts in one message: a weight chunk and some room, far below the server's limit
# for rollout frames, so a holder cannot make a receiver buffer 64 MiB per message
CLIENT_RECEIVE_LIMIT = CHUNK_BYTES + 1024 * 1024
# statuses by which a learner refuses a whole stream, with its reason: the sender reports them as refusals
STREAM_REFUSALS = ("RESOURCE_EXHAUSTED", "UNAUTHENTICATED")


class _Channels:
    """One channel per remote address, reused across calls (a peer id names its address); the
    least recently used are closed beyond `limit`, so member records naming ever new addresses
    cannot grow them without bound."""

    def __init__(self, limit: int = MAX_CHANNELS) -> None:
        self._channels: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.limit = limit

    def get(self, peer: str):
        import grpc

        address = dial_address(peer)
        with self._lock:
            if address not in self._channels:
                options = [("grpc.max_send_message_length", MESSAGE_LIMIT), ("grpc.max_receive_message_length", CLIENT_RECEIVE_LIMIT)]
                self._channels[address] = grpc.insecure_channel(address, options=options)
                while len(self._channels) > self.limit:
                    self._channels.popitem(last=False)[1].close()
            self._channels.move_to_end(address)
            return self._channels[address]

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()


class GrpcPeerServer:
    """This peer's server. Services are attached later (`rollouts`, `weights`); until then a call
    is answered UNIMPLEMENTED, as a peer without that role would. Every call is authenticated
    first (UNAUTHENTICATED, before anything is read, when its signature does not hold)."""

    def __init__(self, host: str, port: int, run_id: str, *, authenticator: Authenticator | None = None,
                 workers: int = StreamLimits().total + RESERVE_WORKERS) -> None:
        import grpc

        self.run_id, self.workers = run_id, workers
        self.weight_send_s = WEIGHT_SEND_S  # longest a receiver may take to read one weight chunk
        self.authenticator = authenticator or Authenticator()
        self.rollout_handler = None  # fn(frames iterator, sender's name, context) -> acks iterator
        self.weight_handler = None  # fn(request dict, caller's key id, its peer id) -> messages iterator
        self._names: OrderedDict[str, str] = OrderedDict()  # key id -> the name its calls go by here
        self._names_lock = threading.Lock()
        handlers = {
            "Rollouts": grpc.stream_stream_rpc_method_handler(self._rollouts, request_deserializer=None, response_serializer=pack),
            "Weights": grpc.stream_stream_rpc_method_handler(self._weights, request_deserializer=None, response_serializer=None),
        }
        self.server = new_server(workers=workers)
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(f"{SERVICE}.Peer", handlers)])
        self.port = bind(self.server, host, port)
        self.address = f"{host}:{self.port}"
        self.watchdog = Watchdog()  # after bind: a port in use leaves no thread behind
        self.server.start()

    def name_of(self, caller: Caller) -> str:
        """The one name a key's calls go by here: the peer id it first claimed (its key id, then the
        address it gave as a display). Bans, counts and queue shares key on it, so on the key:
        claiming another address later changes nothing."""
        with self._names_lock:
            name = self._names.get(caller.key)
            if name is None:
                name = self._names[caller.key] = caller.peer
                while len(self._names) > REMEMBERED_NAMES:
                    self._names.popitem(last=False)
            else:
                self._names.move_to_end(caller.key)
            return name

    def _rollouts(self, frames: Iterator[bytes], context):
        import grpc

        caller = authenticate(self.authenticator, context, ROLLOUTS, b"", self.run_id)  # the stream's signed opening
        handler = self.rollout_handler
        if handler is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this peer takes no rollouts (not a learner)")
        yield from handler(frames, self.name_of(caller), context)

    def _weights(self, requests: Iterator[bytes], context):
        import grpc

        watch = self.watchdog.watch(context)
        try:
            try:
                body = first_request(requests, watch, WEIGHT_REQUEST_LIMIT)
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            caller = authenticate(self.authenticator, context, WEIGHTS, body, self.run_id)
            handler = self.weight_handler
            if handler is None:
                context.abort(grpc.StatusCode.UNIMPLEMENTED, "this peer serves no weights")
            try:
                request = unpack(body)
            except Exception as exc:  # noqa: BLE001  msgpack raises several types on garbage
                yield pack({"ok": False, "reason": f"unreadable weight request: {type(exc).__name__}"})
                return
            if not isinstance(request, dict):
                yield pack({"ok": False, "reason": "a weight request is a map {have, want}"})
                return
            try:
                for message in handler(request, caller.key, caller.peer):
                    watch.expect(self.weight_send_s)  # a receiver that stops reading is cut, and frees this thread
                    yield message
                    watch.hold()
            except ChunkCutOff as exc:  # a chunk passed on as it arrived here did not arrive whole: the requester asks again
                context.abort(grpc.StatusCode.ABORTED, str(exc))
        finally:
            watch.close()

    def stop(self) -> None:
        self.server.stop(grace=1.0).wait(5)
        self.watchdog.close()


class _Once:
    """Runs `fn` the first time it is called, from whichever thread comes first."""

    def __init__(self, fn) -> None:
        self._fn, self._lock, self._done = fn, threading.Lock(), False

    def __call__(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._fn()


class GrpcRolloutInbox(InboxCore):
    """A learner's inbox on its gRPC server. Backpressure: a full queue blocks the server thread,
    which stops reading the sender's stream, and gRPC flow control holds the sender back. Senders
    are known by their key (see GrpcPeerServer.name_of), and each stream counts against
    StreamLimits: refused RESOURCE_EXHAUSTED past a limit, cut when idle longer than idle_s."""

    def __init__(self, server: GrpcPeerServer, **options) -> None:
        super().__init__(**options)
        if self.streams.total + RESERVE_WORKERS > server.workers:
            raise ValueError(f"StreamLimits.total={self.streams.total} leaves fewer than {RESERVE_WORKERS} of the server's "
                             f"{server.workers} threads for weight requests; allow at most {server.workers - RESERVE_WORKERS} streams")
        self._server = server
        server.rollout_handler = self._handle

    def _handle(self, frames: Iterator[bytes], remote: str, context):
        import grpc

        refused = self.open_stream(remote)
        if refused:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
        watch = self._server.watchdog.watch(context)
        release = _Once(lambda: self._release(remote, watch))
        context.add_callback(release)  # also when gRPC drops this generator unfinished (a cut during a write)
        try:
            while True:
                watch.expect(self.streams.idle_s)  # the sender's turn: send the next frame
                try:
                    frame = next(frames)
                except StopIteration:
                    return
                except grpc.RpcError:
                    return  # cut by the watchdog (counted on release) or cancelled by the sender
                watch.hold()  # checking and queueing it is the learner's time, not the sender's
                ack = self._ack(frame, remote)
                watch.expect(self.streams.idle_s)  # taking the ack is the sender's part again
                yield ack
        finally:
            release()

    def _ack(self, frame: bytes, remote: str) -> dict:
        if len(frame) > self.limits.max_frame_bytes:
            self.penalize(remote, "oversized frame")
            return {"ok": False, "reason": f"frame of {len(frame)} bytes exceeds {self.limits.max_frame_bytes}"}
        return self.accept_blocking(frame, remote)

    def _release(self, remote: str, watch) -> None:
        watch.close()
        self.close_stream(remote)
        if watch.cut:  # counted as the hivemind inbox counts its timeouts
            self.stats.reasons["slow sender"] += 1
            self.note_refusal(remote, f"a stream idle past {self.streams.idle_s:g}s was closed")

    def close(self) -> None:
        self.closed.set()
        self._server.rollout_handler = None


class GrpcRolloutSender:
    """Streams groups to a learner under this peer's signature. A learner that refuses the stream
    itself (too many streams open, a signature it does not take) answers every group with its reason."""

    def __init__(self, channels: _Channels, signer: RequestSigner, *, timeout_s: float = 60.0) -> None:
        self._channels, self._signer, self.timeout_s = channels, signer, timeout_s

    def send(self, learner_peer: str, groups) -> list[dict]:
        from swarm.fabric.wire import encode_group

        return self.send_frames(learner_peer, [encode_group(g) for g in groups])

    def send_frames(self, learner_peer: str, frames: Sequence[bytes]) -> list[dict]:
        import grpc

        frames = list(frames)
        call = self._channels.get(learner_peer).stream_stream(ROLLOUTS, request_serializer=None, response_deserializer=unpack)
        try:
            return list(call(iter(frames), timeout=self.timeout_s, metadata=self._signer.metadata(ROLLOUTS)))
        except grpc.RpcError as exc:
            if exc.code() is not None and exc.code().name in STREAM_REFUSALS:
                return [{"ok": False, "reason": exc.details()} for _ in frames]
            raise

    def close(self) -> None:
        pass  # channels belong to the fabric


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


class GrpcFabric:
    transport = "grpc"
    member_pages = MAX_MEMBER_PAGES  # Members pages one listing follows at most

    def __init__(self, registry: str, run_id: str, signing_key, *, host: str = "127.0.0.1", port: int = 0,
                 heartbeat_s: float, expiry_heartbeats: float = EXPIRY_HEARTBEATS, serve: bool = True,
                 timeout_s: float = 10.0, announce_addr: str | None = None, upload_slots: int | None = None) -> None:
        self.registry, self.run_id, self.signing_key = registry, run_id, signing_key
        self._heartbeat_s, self.expiry_s, self.timeout_s = heartbeat_s, heartbeat_s * expiry_heartbeats, timeout_s
        self.upload_slots = upload_slots
        self._dialable = serve
        self.key_id = key_id(owner_key(signing_key))
        self.channels = _Channels()
        self.pusher = AnnouncementPusher(signing_key, lambda: self.weight_client(timeout_s=PUSH_TIMEOUT_S))
        self.server = GrpcPeerServer(host, port, run_id) if serve else None
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
        import grpc

        from swarm.fabric.addresses import (
            announced_address,
            host_port,
            interface_addresses,
            is_wildcard,
            outbound_address,
            usable_ip,
        )

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
        """One signed registry call (the request streamed as one message: see grpc_common)."""
        path, body = f"/{SERVICE}.Registry/{method}", pack(request)
        call = self.channels.get(self.registry).stream_unary(path, request_serializer=None, response_deserializer=unpack)
        return call(iter([body]), timeout=self.timeout_s, metadata=self.signer.metadata(path, body))

    def _check_registry(self) -> None:
        import grpc

        from swarm.config import split_host_port
        from swarm.fabric.addresses import refuses_connections

        host, port = split_host_port(self.registry)
        if port is not None and refuses_connections(host, port):  # gRPC would retry until its timeout
            self.shutdown()
            raise JoinError(f"could not join the swarm through the registry at {self.registry}: connection refused "
                            "(nothing listens there). Check the address and port, and that `swarm bootstrap "
                            "--transport grpc` runs there")
        try:
            grpc.channel_ready_future(self.channels.get(self.registry)).result(timeout=self.timeout_s)
        except grpc.FutureTimeoutError:
            self.shutdown()
            raise JoinError(f"could not join the swarm through the registry at {self.registry}: no answer within "
                            f"{self.timeout_s:.0f}s. Check that `swarm bootstrap --transport grpc` runs there and is reachable") from None

    @property
    def peer_id(self) -> str:
        """`KEYID@host:port`: this peer's key id and the address it serves on (grpc_common)."""
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
        from swarm.fabric.grpc_registry import members_from

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
                 sharers: Sequence[str] = ()) -> bool:
        from swarm.fabric.records import VersionAnnouncement

        announcement = VersionAnnouncement.of(self.run_id, version, digest, self.peer_id, time.time(), sampling, recent,
                                              chunks, sharers=sharers)
        self.pusher.push(announcement)  # the named sharers hear of it first, while the registry stores it
        payload = pack(announcement.dict())
        reply = self._call("Announce", {"run_id": self.run_id, "owner": self.public_key, "payload": payload,
                                        "signature": self.signing_key.sign(payload)})
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

    def rollout_inbox(self, **options):
        return GrpcRolloutInbox(self.server, **options)

    def rollout_sender(self, **options):
        return GrpcRolloutSender(self.channels, self.signer, **options)

    def weight_server(self, store):
        return GrpcWeightServer(self.server, store, slots=self.upload_slots)

    def weight_client(self, **options):
        return GrpcWeightClient(self.channels, self.signer, **options)

    def unreachable_errors(self) -> tuple[type[BaseException], ...]:
        import grpc

        return (grpc.RpcError, ConnectionError, TimeoutError, OSError, StopIteration)

    def shutdown(self) -> None:
        self.pusher.close()
        if self.server is not None:
            self.server.stop()
        self.channels.close()
