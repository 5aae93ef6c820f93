"""A peer of a gRPC swarm (see grpc_common.py): its own server for rollouts and weights, the
clients that reach other peers and the registry, and `GrpcFabric`, which implements the fabric
interface (interface.py) like `HivemindFabric` does."""

from __future__ import annotations

import logging
import threading

import msgpack
import time
from typing import Iterable, Iterator, Sequence

from swarm.fabric.grpc_common import (
    CHUNK_BYTES,
    PEER_HEADER,
    SERVICE,
    bind,
    channel_options,
    new_server,
    owner_key,
    pack,
    unpack,
    verify_owner_signature,
)
from swarm.fabric.interface import JoinError
from swarm.fabric.records import EXPIRY_HEARTBEATS, Heartbeat
from swarm.fabric.rollout_exchange import InboxCore
from swarm.fabric.versions import Announced, RebuildingClient, check_payload_size, newest_authorised
from swarm.fabric.weight_delta import CorruptVersion

logger = logging.getLogger(__name__)


class _Channels:
    """One channel per remote address, reused across calls."""

    def __init__(self) -> None:
        self._channels: dict = {}
        self._lock = threading.Lock()

    def get(self, address: str):
        import grpc

        with self._lock:
            if address not in self._channels:
                self._channels[address] = grpc.insecure_channel(address, options=channel_options())
            return self._channels[address]

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()


class GrpcPeerServer:
    """This peer's server. Services are attached later (`rollouts`, `weights`); until then a call
    is answered UNIMPLEMENTED, as a peer without that role would."""

    def __init__(self, host: str, port: int) -> None:
        import grpc

        self.rollout_handler = None  # fn(frames iterator, remote) -> acks iterator
        self.weight_handler = None  # fn(request dict) -> messages iterator
        handlers = {
            "Rollouts": grpc.stream_stream_rpc_method_handler(self._rollouts, request_deserializer=None, response_serializer=pack),
            "Weights": grpc.unary_stream_rpc_method_handler(self._weights, request_deserializer=unpack, response_serializer=None),
        }
        self.server = new_server()
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(f"{SERVICE}.Peer", handlers)])
        self.port = bind(self.server, host, port)
        self.address = f"{host}:{self.port}"
        self.server.start()

    def _rollouts(self, frames: Iterator[bytes], context):
        import grpc

        if self.rollout_handler is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this peer takes no rollouts (not a learner)")
        remote = dict(context.invocation_metadata()).get(PEER_HEADER) or context.peer()
        yield from self.rollout_handler(frames, remote)

    def _weights(self, request: dict, context):
        import grpc

        if self.weight_handler is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this peer serves no weights")
        yield from self.weight_handler(request)

    def stop(self) -> None:
        self.server.stop(grace=1.0).wait(5)


class GrpcRolloutInbox(InboxCore):
    """A learner's inbox on its gRPC server. Backpressure: a full queue blocks the server thread,
    which stops reading the sender's stream, and gRPC flow control holds the sender back. Bans key
    on the address a sender claims (gRPC has no peer authentication: see the README)."""

    def __init__(self, server: GrpcPeerServer, **options) -> None:
        super().__init__(**options)
        self._server = server
        server.rollout_handler = self._handle

    def _handle(self, frames: Iterator[bytes], remote: str):
        for frame in frames:
            if len(frame) > self.limits.max_frame_bytes:
                self.penalize(remote, "oversized frame")
                yield {"ok": False, "reason": f"frame of {len(frame)} bytes exceeds {self.limits.max_frame_bytes}"}
                continue
            yield self.accept_blocking(frame, remote)

    def close(self) -> None:
        self._server.rollout_handler = None


class GrpcRolloutSender:
    def __init__(self, channels: _Channels, own_address: str, *, timeout_s: float = 60.0) -> None:
        self._channels, self._own, self.timeout_s = channels, own_address, timeout_s

    def send(self, learner_peer: str, groups) -> list[dict]:
        from swarm.fabric.wire import encode_group

        return self.send_frames(learner_peer, [encode_group(g) for g in groups])

    def send_frames(self, learner_peer: str, frames: Sequence[bytes]) -> list[dict]:
        call = self._channels.get(learner_peer).stream_stream(f"/{SERVICE}.Peer/Rollouts", request_serializer=None,
                                                                 response_deserializer=unpack)
        return list(call(iter(list(frames)), timeout=self.timeout_s, metadata=((PEER_HEADER, self._own),)))

    def close(self) -> None:
        pass  # channels belong to the fabric


class GrpcWeightServer:
    """Serves the versions in `store`: a header (count and size of each payload), then chunks."""

    def __init__(self, server: GrpcPeerServer, store) -> None:
        self.store, self.served, self._server = store, 0, server
        server.weight_handler = self._handle

    def _handle(self, request: dict):
        have, want = request.get("have"), request.get("want")
        try:
            payloads = self.store.payloads(have if isinstance(have, int) else None, int(want))
        except (KeyError, TypeError, ValueError) as exc:
            yield pack({"ok": False, "reason": str(exc)})
            return
        yield pack({"ok": True, "sizes": [len(p) for p in payloads]})
        for payload in payloads:
            for start in range(0, len(payload), CHUNK_BYTES):
                yield payload[start : start + CHUNK_BYTES]
        self.served += 1

    def close(self) -> None:
        self._server.weight_handler = None


class GrpcWeightClient(RebuildingClient):
    def __init__(self, channels: _Channels, *, timeout_s: float = 120.0) -> None:
        self._channels, self.timeout_s = channels, timeout_s

    def _payloads(self, holder: str, have: int | None, want: int) -> list[bytes]:
        call = self._channels.get(holder).unary_stream(f"/{SERVICE}.Peer/Weights", request_serializer=pack,
                                                       response_deserializer=None)
        messages = call({"have": have, "want": want}, timeout=self.timeout_s)
        try:
            header = unpack(next(messages))
        except (ValueError, msgpack.UnpackException) as exc:
            raise CorruptVersion(f"holder {holder} sent an unreadable header: {exc}") from exc
        if not isinstance(header, dict) or not isinstance(header.get("sizes", []), list):
            raise CorruptVersion(f"holder {holder} sent a malformed header")
        if not header.get("ok"):
            raise KeyError(f"holder {holder} cannot serve version {want}: {header.get('reason')}")
        payloads = []
        for size in header["sizes"]:
            check_payload_size(size, holder)
            parts, got = [], 0
            while got < size:
                chunk = next(messages)  # StopIteration (a cut stream) is an incomplete transfer
                parts.append(chunk)
                got += len(chunk)
            payloads.append(b"".join(parts))  # a wrong size or content fails the hash check
        return payloads

    def close(self) -> None:
        pass


class GrpcFabric:
    transport = "grpc"

    def __init__(self, registry: str, run_id: str, signing_key, *, host: str = "127.0.0.1", port: int = 0,
                 heartbeat_s: float, expiry_heartbeats: float = EXPIRY_HEARTBEATS, serve: bool = True,
                 timeout_s: float = 10.0) -> None:
        self.registry, self.run_id, self.signing_key = registry, run_id, signing_key
        self._heartbeat_s, self.expiry_s, self.timeout_s = heartbeat_s, heartbeat_s * expiry_heartbeats, timeout_s
        self.channels = _Channels()
        self.server = GrpcPeerServer(host, port) if serve else None
        self._token = ""
        self._check_registry()

    def _call(self, method: str, request: dict) -> dict:
        call = self.channels.get(self.registry).unary_unary(f"/{SERVICE}.Registry/{method}", request_serializer=pack,
                                                            response_deserializer=unpack)
        return call(request, timeout=self.timeout_s)

    def _check_registry(self) -> None:
        import grpc

        try:
            grpc.channel_ready_future(self.channels.get(self.registry)).result(timeout=self.timeout_s)
        except grpc.FutureTimeoutError:
            self.shutdown()
            raise JoinError(f"could not join the swarm through the registry at {self.registry}: no answer within "
                            f"{self.timeout_s:.0f}s. Check that `swarm bootstrap --transport grpc` runs there and is reachable") from None

    @property
    def peer_id(self) -> str:
        return self.server.address if self.server else ""

    @property
    def public_key(self) -> bytes:
        return owner_key(self.signing_key)

    @property
    def heartbeat_s(self) -> float:
        return self._heartbeat_s

    def addresses(self) -> list[str]:
        return [self.registry]  # over gRPC, peers join through the registry

    def now(self) -> float:
        return time.time()

    def heartbeat(self, beat: Heartbeat) -> bool:
        record = beat.record(self.peer_id, self.now()).dict()
        reply = self._call("Heartbeat", {"run_id": self.run_id, "peer_id": self.peer_id, "token": self._token,
                                         "record": record, "expiry_s": self.expiry_s})
        if reply.get("ok"):
            self._token = reply["token"]
        else:
            logger.warning("registry refused our record: %s", reply.get("reason"))
        return bool(reply.get("ok"))

    def members(self):
        from swarm.fabric.grpc_registry import members_from

        return members_from(self._call("Members", {"run_id": self.run_id})["members"])

    def announce(self, version: int, digest: str) -> bool:
        from swarm.fabric.records import VersionAnnouncement

        payload = pack(VersionAnnouncement(run_id=self.run_id, version=version, hash=digest, peer_id=self.peer_id,
                                           time=time.time()).dict())
        reply = self._call("Announce", {"run_id": self.run_id, "owner": self.public_key, "payload": payload,
                                        "signature": self.signing_key.sign(payload)})
        return bool(reply.get("ok"))

    def latest_announced(self, learner_keys: Iterable[bytes]) -> Announced | None:
        """The newest announcement under `learner_keys`, each signature checked here again (the
        registry is not trusted with the learners' authority)."""
        items, learner_keys = [], list(learner_keys)
        # asking for the keys we follow keeps the reply small however many other keys announce
        for item in self._call("Versions", {"run_id": self.run_id, "owners": learner_keys})["versions"]:
            owner, payload = bytes(item["owner"]), bytes(item["payload"])
            if verify_owner_signature(owner, payload, bytes(item["signature"])):
                items.append((owner, unpack(payload)))
        return newest_authorised(items, learner_keys, self.run_id)

    def rollout_inbox(self, **options):
        return GrpcRolloutInbox(self.server, **options)

    def rollout_sender(self, **options):
        return GrpcRolloutSender(self.channels, self.peer_id, **options)

    def weight_server(self, store):
        return GrpcWeightServer(self.server, store)

    def weight_client(self, **options):
        return GrpcWeightClient(self.channels, **options)

    def unreachable_errors(self) -> tuple[type[BaseException], ...]:
        import grpc

        return (grpc.RpcError, ConnectionError, TimeoutError, OSError, StopIteration)

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.channels.close()
