"""Rollout groups from samplers to a learner over hivemind's p2p streams.

One stream per send: the sampler (`RolloutSender`) writes length-prefixed msgpack frames
(rollouts/wire.py), one per group, and reads one small ack per frame; an ack marked `final` refuses
the rest of the stream too (past a peer's stream limit, or at a frame too big to skip). The
learner side (`RolloutInbox`) is rollouts/inbox.py's InboxCore served on a stream handler.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

import msgpack
from hivemind.p2p import P2P

from swarm.fabric.hivemind.loop import HostedStreamHandler, StreamClient, close_after_requester, close_stream
from swarm.fabric.rollouts.inbox import InboxCore
from swarm.fabric.rollouts.wire import encode_group
from swarm.rollouts import RolloutGroup

logger = logging.getLogger(__name__)


# how long a learner keeps a refused rollout stream open for the sender to read the refusal and
# close (an honest one does at once; a flood of refused streams holds an idle coroutine each this long)
REFUSAL_LINGER_S = 5.0


def handler_name(run_id: str) -> str:
    return f"gepo-swarm/{run_id}/rollouts/v1"


class RolloutInbox(InboxCore):
    """The inbox served over hivemind p2p streams (handler `handler_name(run_id)`)."""

    def __init__(self, dht, run_id: str, **options) -> None:
        super().__init__(**options)
        self._host = HostedStreamHandler(dht, handler_name(run_id), self._handle, thread_name="rollout-inbox")

    async def _handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        remote = str(stream_info.peer_id)
        refused = self.open_stream(remote)
        if refused:
            await self._refuse_stream(reader, writer, refused)
            return
        try:
            while True:
                try:
                    header = await asyncio.wait_for(reader.readexactly(P2P.HEADER_LEN), self.streams.idle_s)
                except asyncio.IncompleteReadError:
                    return  # the sender closed the stream
                size = int.from_bytes(header, P2P.BYTEORDER)
                if size > self.limits.max_frame_bytes:
                    self.penalise(remote, "oversized frame")
                    # cannot resynchronise without reading it: the rest of the stream is refused
                    await self._refuse_stream(reader, writer, f"frame of {size} bytes exceeds {self.limits.max_frame_bytes}")
                    return
                # a half-received frame raises here and is dropped; so is one that comes too slowly
                frame = await asyncio.wait_for(reader.readexactly(size), self.streams.frame_deadline(size))
                ack = await self.accept(frame, remote)
                await P2P.send_raw_data(msgpack.packb(ack), writer)
        except asyncio.TimeoutError:
            self.stats.reasons["slow sender"] += 1
            self.note_refusal(remote, "a stream idle or too slow past its deadline was closed")
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            logger.debug("rollout stream from %s broke: %s", remote, exc)
        except asyncio.CancelledError:
            pass  # the inbox is closing; ending quietly keeps asyncio from logging the cancellation
        finally:
            self.close_stream(remote)
            writer.close()

    async def _refuse_stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reason: str) -> None:
        """Refuse the frame at hand and every one after it on this stream (`final`: the sender
        stops there), then close once the sender has read that and closed its end: closing first
        can reset the stream before the refusal reaches the sender (loop.close_after_requester),
        which then knew only that the learner was unreachable."""

        try:
            await P2P.send_raw_data(msgpack.packb({"ok": False, "reason": reason, "final": True}), writer)
        except (ConnectionError, asyncio.CancelledError):  # the sender is gone, or the inbox is closing
            writer.close()
            return
        await close_after_requester(reader, writer, REFUSAL_LINGER_S)

    def close(self) -> None:
        self.closed.set()
        self._host.close()


class RolloutSender:
    """Sends rollout groups to a learner peer; returns one ack per group ({"ok": bool, "reason"})."""

    def __init__(self, dht, run_id: str, *, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._client = StreamClient(dht, handler_name(run_id), thread_name="rollout-sender")

    def send(self, learner_peer: str, groups: Sequence[RolloutGroup]) -> list[dict]:
        return self._client.run(self._send([encode_group(g) for g in groups], learner_peer), timeout=self.timeout_s)

    def send_frames(self, learner_peer: str, frames: Sequence[bytes]) -> list[dict]:
        """Raw frames (tests use this to send malformed data)."""
        return self._client.run(self._send(list(frames), learner_peer), timeout=self.timeout_s)

    async def _send(self, frames: list[bytes], peer_id) -> list[dict]:
        reader, writer = await self._client.open(peer_id)

        async def write_all() -> None:
            # frames are pipelined: the next one goes out while earlier acks are still on their
            # way back (one round trip per frame would cap a stream at ~1/latency groups per s)
            for frame in frames:
                await P2P.send_raw_data(frame, writer)

        async def read_acks() -> list[dict]:
            acks: list[dict] = []
            while len(acks) < len(frames):
                ack = msgpack.unpackb(await P2P.receive_raw_data(reader), raw=False)
                if not isinstance(ack, dict):
                    ack = {"ok": False, "reason": "the learner's ack is not a map"}
                acks.append(ack)
                if ack.get("final"):  # the learner refused the rest of the stream unread, and closes it
                    acks += [{"ok": False, "reason": ack.get("reason", "?")} for _ in range(len(frames) - len(acks))]
            return acks

        writing = asyncio.ensure_future(write_all())
        try:
            # a final refusal ends the stream with frames still unwritten: the acks decide, not the writes
            acks = await read_acks()
        finally:
            writing.cancel()
            await asyncio.gather(writing, return_exceptions=True)
            close_stream(writer)  # (also when finalised after its loop closed, as WeightClient's requests are)
        return acks

    def close(self) -> None:
        self._client.close()
