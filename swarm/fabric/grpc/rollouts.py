"""Rollout groups over gRPC: a learner's inbox on its server (`GrpcRolloutInbox`, the
transport-neutral InboxCore fed by a stream handler) and the sender that streams groups to it
under this peer's signature (`GrpcRolloutSender`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Iterator, Sequence

import grpc

from swarm.fabric.grpc.common import (
    RequestSigner,
    unpack,
)
from swarm.fabric.grpc.server import RESERVE_WORKERS, ROLLOUTS, Channels, GrpcPeerServer
from swarm.fabric.rollouts.inbox import InboxCore
from swarm.fabric.rollouts.wire import encode_group

logger = logging.getLogger(__name__)


# statuses by which a learner refuses a whole stream, with its reason: the sender reports them as refusals
STREAM_REFUSALS = ("RESOURCE_EXHAUSTED", "UNAUTHENTICATED")


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
    StreamLimits: refused RESOURCE_EXHAUSTED past a limit, cut when idle longer than idle_s, or
    when it trickles (StreamLimits.sender_budget: after rate_grace_s of waiting on its sender, a
    stream must average stream_bytes_per_s), so tiny frames sent now and then hold no slot."""

    def __init__(self, server: GrpcPeerServer, **options) -> None:
        super().__init__(**options)
        if self.streams.total + RESERVE_WORKERS > server.workers:
            raise ValueError(f"StreamLimits.total={self.streams.total} leaves fewer than {RESERVE_WORKERS} of the server's "
                             f"{server.workers} threads for weight requests; allow at most {server.workers - RESERVE_WORKERS} streams")
        self._server = server
        server.rollout_handler = self._handle

    def _handle(self, frames: Iterator[bytes], remote: str, context):
        refused = self.open_stream(remote)
        if refused:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
        watch = self._server.watchdog.watch(context)
        release = _Once(lambda: self._release(remote, watch))
        context.add_callback(release)  # also when gRPC drops this generator unfinished (a cut during a write)
        waited_s, received = 0.0, 0  # the sender's time on this stream (not the learner's), and its bytes
        try:
            while True:
                started = time.monotonic()
                # the sender's turn: the next frame, within idle_s and what its rate so far leaves it
                watch.expect(min(self.streams.idle_s, max(0.0, self.streams.sender_budget(waited_s, received))))
                try:
                    frame = next(frames)
                except StopIteration:
                    return
                except grpc.RpcError:
                    return  # cut by the watchdog (counted on release) or cancelled by the sender
                watch.hold()  # checking and queueing it is the learner's time, not the sender's
                waited_s, received = waited_s + time.monotonic() - started, received + len(frame)
                ack = self._ack(frame, remote)
                watch.expect(self.streams.idle_s)  # taking the ack is the sender's part again
                yield ack
        finally:
            release()

    def _ack(self, frame: bytes, remote: str) -> dict:
        if len(frame) > self.limits.max_frame_bytes:
            self.penalise(remote, "oversized frame")
            return {"ok": False, "reason": f"frame of {len(frame)} bytes exceeds {self.limits.max_frame_bytes}"}
        return self.accept_blocking(frame, remote)

    def _release(self, remote: str, watch) -> None:
        watch.close()
        self.close_stream(remote)
        if watch.cut:  # counted as the hivemind inbox counts its timeouts
            self.stats.reasons["slow sender"] += 1
            self.note_refusal(remote, f"a stream idle past {self.streams.idle_s:g}s, or slower than "
                                      f"{self.streams.stream_bytes_per_s:g} bytes/s, was closed")

    def close(self) -> None:
        self.closed.set()
        self._server.rollout_handler = None


class GrpcRolloutSender:
    """Streams groups to a learner under this peer's signature. A learner that refuses the stream
    itself (too many streams open, a signature it does not take) answers every group with its reason."""

    def __init__(self, channels: Channels, signer: RequestSigner, *, timeout_s: float = 60.0) -> None:
        self._channels, self._signer, self.timeout_s = channels, signer, timeout_s

    def send(self, learner_peer: str, groups) -> list[dict]:
        return self.send_frames(learner_peer, [encode_group(g) for g in groups])

    def send_frames(self, learner_peer: str, frames: Sequence[bytes]) -> list[dict]:
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
