"""A gRPC peer's own server (`GrpcPeerServer`) and its method paths (ROLLOUTS, WEIGHTS), and
the pool of channels by which a peer reaches others (`Channels`).

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
from collections import OrderedDict
from typing import Iterator

import grpc

from swarm.fabric.grpc.common import (CHUNK_BYTES, MESSAGE_LIMIT, SERVICE, Authenticator, Caller, Watchdog, authenticate, bind,
    dial_address, first_request, new_server, pack, unpack)
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
    """One channel per remote address, reused across calls (a peer id names its address); the
    least recently used are closed beyond `limit`, so member records naming ever new addresses
    cannot grow them without bound."""

    def __init__(self, limit: int = MAX_CHANNELS) -> None:
        self._channels: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.limit = limit

    def get(self, peer: str):
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
        caller = authenticate(self.authenticator, context, ROLLOUTS, b"", self.run_id)  # the stream's signed opening
        handler = self.rollout_handler
        if handler is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this peer takes no rollouts (not a learner)")
        yield from handler(frames, self.name_of(caller), context)

    def _weights(self, requests: Iterator[bytes], context):
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


WEIGHTS = f"/{SERVICE}.Peer/Weights"
