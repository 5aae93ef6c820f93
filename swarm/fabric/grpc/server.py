"""A gRPC peer's own server (`GrpcPeerServer`) and its method paths (ROLLOUTS, WEIGHTS), and
the pool of channels by which a peer reaches others (`Channels`).

Every request is signed with the peer's key, and servers know their callers by key: a learner
bans, counts and shares its queue per key (as over hivemind per libp2p id), so a sender that
claims another peer's address harms nobody but itself. The server's thread pool is sized for the
rollout streams the inbox allows (StreamLimits.total) plus a reserve, so weight requests are
served while every stream is held open, and the watchdog cuts a stream idle longer than
StreamLimits.idle_s, or a weight transfer whose receiver stops reading, which frees its thread.
Signatures are checked before a call gets a thread (grpc.common.SignedService), and the server
speaks TLS with a certificate made from the peer's signing key (grpc/tls.py) unless `insecure`.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from typing import Iterator

import grpc

from swarm.fabric.grpc.common import (CHUNK_BYTES, MESSAGE_LIMIT, SERVICE, Authenticator, Caller, Method, OwnerCalls,
    SignedService, Watchdog, bind, key_of_peer, new_server, pack, signed_body, unpack)
from swarm.fabric.grpc.tls import pinned_channel, server_identity
from swarm.fabric.membership.addresses import dial_address
from swarm.fabric.rollouts.inbox import StreamLimits
from swarm.fabric.weights.chunks import ChunkCutOff
from swarm.fabric.weights.versions import WEIGHT_REQUEST_LIMIT

logger = logging.getLogger(__name__)


ROLLOUTS = f"/{SERVICE}.Peer/Rollouts"
RESERVE_WORKERS = 16  # server threads rollout streams can never take: weight requests and refusals run there
WEIGHT_SEND_S = 30.0  # longest a receiver may take to read one chunk (4 MiB: at least ~140 KB/s)
REMEMBERED_NAMES = 100_000
MAX_CHANNELS = 256  # open channels to other peers (the registry's among them), least recently used closed first
# what a client accepts in one message: a weight chunk and some room, far below the server's limit
# for rollout frames, so a holder cannot make a receiver buffer 64 MiB per message
CLIENT_RECEIVE_LIMIT = CHUNK_BYTES + 1024 * 1024


class Channels:
    """One channel per remote address and key, reused across calls (a peer id names both); the
    least recently used are closed beyond `limit`, so member records naming ever new addresses
    cannot grow them without bound. Over TLS (unless `insecure`) a channel trusts only the
    certificate of the key the peer id names (grpc/tls.py): a new channel costs one extra TLS
    handshake, to read that certificate, and raises tls.WrongPeerKey (a ConnectionError) when the
    server holds another key."""

    def __init__(self, limit: int = MAX_CHANNELS, *, insecure: bool = False) -> None:
        self._channels: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.limit, self.insecure = limit, insecure

    def get(self, peer: str):
        address, key = dial_address(peer), key_of_peer(peer)
        with self._lock:
            channel = self._channels.get((address, key))
            if channel is not None:
                self._channels.move_to_end((address, key))
                return channel
        options = [("grpc.max_send_message_length", MESSAGE_LIMIT), ("grpc.max_receive_message_length", CLIENT_RECEIVE_LIMIT)]
        # the handshake that reads the certificate happens outside the lock: a slow peer holds up no other dial
        channel = grpc.insecure_channel(address, options=options) if self.insecure else pinned_channel(address, key, options)
        with self._lock:
            if (address, key) in self._channels:  # another thread dialled it meanwhile
                channel.close()
                channel = self._channels[(address, key)]
            else:
                self._channels[(address, key)] = channel
                while len(self._channels) > self.limit:
                    self._channels.popitem(last=False)[1].close()
            self._channels.move_to_end((address, key))
            return channel

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
                 workers: int = StreamLimits().total + RESERVE_WORKERS, signing_key=None, insecure: bool = False,
                 calls: OwnerCalls | None = None) -> None:
        """signing_key: the peer's key (hivemind RSAPrivateKey), whose certificate the server presents
        over TLS; insecure: plain text instead (GrpcFabric warns of it); a server with neither is refused."""
        if signing_key is None and not insecure:
            raise ValueError("a gRPC peer server needs the peer's signing key for TLS, or insecure=True for plain text")
        self.run_id, self.workers, self.insecure = run_id, workers, insecure
        self.weight_send_s = WEIGHT_SEND_S  # longest a receiver may take to read one weight chunk
        self.authenticator = authenticator or Authenticator()
        self.rollout_handler = None  # fn(frames iterator, sender's name, context) -> acks iterator
        self.weight_handler = None  # fn(request dict, caller's key id, its peer id) -> messages iterator
        self._names: OrderedDict[str, str] = OrderedDict()  # key id -> the name its calls go by here
        self._names_lock = threading.Lock()
        methods = {"Rollouts": Method(self._rollouts, streams_replies=True, response_serializer=pack),
                   "Weights": Method(self._weights, streams_replies=True)}
        self.service = SignedService(f"{SERVICE}.Peer", methods, self.authenticator, run_id=run_id, calls=calls)
        self.server = new_server(workers=workers)
        self.server.add_generic_rpc_handlers([self.service])
        identity = None if insecure else server_identity(signing_key)
        self.key_id = identity.key_id if identity else ""  # the key whose certificate it presents ("" in plain text)
        self.port = bind(self.server, host, port, identity)
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

    def _rollouts(self, frames: Iterator[bytes], context, caller: Caller):
        # the stream's signed opening (an empty body; its frames travel under TLS)
        if caller.body_digest != EMPTY_DIGEST:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "a rollout stream's opening signs an empty body")
        handler = self.rollout_handler
        if handler is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this peer takes no rollouts (not a learner)")
        yield from handler(frames, self.name_of(caller), context)

    def _weights(self, requests: Iterator[bytes], context, caller: Caller):
        watch = self.watchdog.watch(context)
        try:
            body = signed_body(requests, watch, context, caller, WEIGHT_REQUEST_LIMIT)
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


WEIGHTS = f"/{SERVICE}.Peer/Weights"
EMPTY_DIGEST = hashlib.sha256(b"").digest()
