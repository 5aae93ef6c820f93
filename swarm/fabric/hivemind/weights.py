"""Policy versions over hivemind's p2p streams: every peer serves the versions it holds
(`WeightServer`: whole payloads, manifests and chunks, within its upload slots, and pushed
announcements), and `WeightClient` fetches them from holders and rebuilds them
(weights/versions.py's RebuildingClient).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable

import msgpack
from hivemind.p2p import P2P

from swarm.fabric.hivemind.loop import HostedStreamHandler, StreamClient, close_after_requester, close_stream
from swarm.fabric.weights.announcement_push import MAX_PENDING_PUSHES, PUSH_OP, answer_push
from swarm.fabric.weights.chunks import (
    MAX_WAITERS,
    SLOT_WAIT_S,
    ChunkCutOff,
    ChunkFeed,
    chunk_answer,
    claim_chunk,
    forward_piece_bytes,
    slot_share,
    takes_slot,
)
from swarm.fabric.weights.delta import (
    MAX_PAYLOAD_BYTES,
    CorruptVersion,
)
from swarm.fabric.weights.upload_slots import HolderBusy, UploadSlots
from swarm.fabric.weights.rebuilding_client import RebuildingClient, refuse_unless_ok
from swarm.fabric.weights.versions import (
    HEADER_LIMIT,
    WEIGHT_REQUEST_LIMIT,
    VersionStore,
    check_payload_count,
    check_payload_size,
    send_deadline,
)

logger = logging.getLogger(__name__)


RECEIVE_PIECE_BYTES = 1 << 20  # a whole payload is read in pieces of this size when its progress is followed
# Manifest and chunk requests that say `keep` are answered on a stream kept open for the next one
# (the answer's header says `kept`): each new stream costs both p2p daemons a socket, a libp2p
# stream and its protocol negotiation, once per 1 MiB chunk before (issue 44). A server that does
# not know `keep` answers once and closes, and the client opens a new stream each time, as before.
KEEP_IDLE_S = 10.0  # a kept stream with no request for this long is closed by its server
POOL_IDLE_S = 5.0  # ... and not used again by its client after this long (well before the server closes it)
POOLED_PER_PEER = 16  # kept streams per peer (a fetch asks one peer up to SHARED_WORKERS chunks at once)
POOLED_PEERS = 64  # peers with kept streams (the least recently used are closed beyond)


def handler_name(run_id: str) -> str:
    return f"gepo-swarm/{run_id}/weights/v1"


class WeightServer:
    """Serves the versions in `store` to any peer that asks, at most `slots` at once."""

    def __init__(self, dht, run_id: str, store: VersionStore, *, slots: int | None = None) -> None:
        self.store = store
        self.served = self.bytes_served = 0
        self.slots = UploadSlots(slots)
        # chunk requests wait (for a chunk still on its way, for a slot) on threads of their own,
        # never on the event loop that serves every stream
        self._waits = ThreadPoolExecutor(MAX_WAITERS + 4, thread_name_prefix="chunk-wait")
        self._pushes = ThreadPoolExecutor(1, thread_name_prefix="push-check")
        self._pending_pushes = 0
        self._host = HostedStreamHandler(dht, handler_name(run_id), self._handle, thread_name="weight-server")

    async def _handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sent = 0  # payload bytes: the requester gets as long again to read them before the close
        try:
            async def refuse(reason: str) -> None:
                await P2P.send_raw_data(msgpack.packb({"ok": False, "reason": reason[:200], "count": 0}), writer)

            size = int.from_bytes(await asyncio.wait_for(reader.readexactly(P2P.HEADER_LEN), 30), P2P.BYTEORDER)
            if size > WEIGHT_REQUEST_LIMIT:
                await refuse(f"a weight request of {size} bytes")
                return
            try:  # whatever a requester sends, it gets an answer, never an exception in this handler
                request = msgpack.unpackb(await asyncio.wait_for(reader.readexactly(size), 30), raw=False)
                if isinstance(request, dict) and request.get("op") == PUSH_OP:  # a learner's announcement
                    await P2P.send_raw_data(msgpack.packb(await self._push_answer(request)), writer)
                    return
                if isinstance(request, dict) and "op" in request:  # a manifest or a chunk (more, when kept)
                    try:
                        sent = await self._chunks(request, reader, writer, str(stream_info.peer_id))
                    except ChunkCutOff as exc:  # cut at once: the requester asks again
                        logger.debug("chunk passed on to %s cut off: %s", stream_info.peer_id, exc)
                        writer.close()
                    return
                have, want = request.get("have"), request.get("want")
                if not isinstance(want, int) or isinstance(want, bool):
                    raise ValueError(f"want must be a version number, not {want!r}")
            except (asyncio.IncompleteReadError, asyncio.TimeoutError):
                raise
            except Exception as exc:  # noqa: BLE001  garbage, a map without `get`
                await refuse(f"{type(exc).__name__}: {exc}")
                return
            # the slot first: a request that is refused costs no encoding
            if not self.slots.take():
                await P2P.send_raw_data(msgpack.packb(self.slots.busy_reply()), writer)
                return
            try:
                try:
                    payloads = self.store.payloads(have if isinstance(have, int) and not isinstance(have, bool) else None, want)
                except HolderBusy as exc:  # an old version being rebuilt: ask again shortly, no blame
                    await P2P.send_raw_data(msgpack.packb({"ok": False, "busy": True, "reason": f"busy: {exc}"[:200], "count": 0}), writer)
                    return
                except (KeyError, TypeError, ValueError) as exc:  # a version not held
                    await refuse(f"{type(exc).__name__}: {exc}")
                    return
                await P2P.send_raw_data(msgpack.packb({"ok": True, "count": len(payloads)}), writer)
                for payload in payloads:
                    # a receiver that stops reading would otherwise hold this upload slot for good
                    await asyncio.wait_for(P2P.send_raw_data(payload, writer), send_deadline(len(payload)))
                    self.bytes_served += len(payload)
                    sent += len(payload)
                self.served += 1
            finally:
                self.slots.release()
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError) as exc:
            logger.debug("weight request from %s failed: %s", stream_info.peer_id, exc)
        except asyncio.CancelledError:
            pass  # the server is closing
        finally:
            await close_after_requester(reader, writer, send_deadline(sent))

    async def _push_answer(self, request: dict) -> dict:
        """The answer to a pushed announcement, its signature checked on a thread of its own (off the
        loop, and off the chunk requests' threads); busy while MAX_PENDING_PUSHES wait already."""
        if self._pending_pushes >= MAX_PENDING_PUSHES:
            return {"ok": False, "busy": True, "reason": "busy: too many pushed announcements wait here", "count": 0}
        self._pending_pushes += 1  # (only ever changed on the loop)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pushes, answer_push, self.store.book.on_pushed,
                                                                    request)
        finally:
            self._pending_pushes -= 1

    async def _chunks(self, request: dict, reader, writer, peer: str) -> int:
        """Answers a manifest or chunk request and, while the requester says `keep`, the next ones
        on the same stream (until it closes its end, sends anything else, or idles KEEP_IDLE_S);
        returns the payload bytes sent."""
        sent = 0
        while True:
            keep = request.get("keep") is True
            sent += await self._chunk(request, writer, peer, keep)
            if not keep:
                return sent
            try:
                head = await asyncio.wait_for(reader.readexactly(P2P.HEADER_LEN), KEEP_IDLE_S)
            except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
                return sent  # the requester closed its end, or left the stream idle
            size = int.from_bytes(head, P2P.BYTEORDER)
            if size > WEIGHT_REQUEST_LIMIT:
                await P2P.send_raw_data(msgpack.packb({"ok": False, "reason": f"a weight request of {size} bytes",
                                                       "count": 0}), writer)
                return sent
            try:
                request = msgpack.unpackb(await asyncio.wait_for(reader.readexactly(size), 30), raw=False)
            except (ValueError, msgpack.UnpackException) as exc:
                request = {"op": None, "why": f"{type(exc).__name__}"}
            if not isinstance(request, dict) or request.get("op") not in ("manifest", "chunk"):
                # only chunk requests follow on a kept stream: anything else is answered and ends it
                await P2P.send_raw_data(msgpack.packb({"ok": False, "reason": "a kept stream carries manifest and chunk "
                                                       "requests only", "count": 0}), writer)
                return sent

    async def _chunk(self, request: dict, writer, peer: str, keep: bool = False) -> int:
        """Answers a manifest or chunk request; returns the payload bytes sent. `keep`: the header
        says `kept` (the stream stays open for the requester's next one)."""

        # the lookup may wait for a chunk on its way: on a thread. The slot is taken here, in this
        # coroutine's own step: a slot taken on a thread for a request cancelled meanwhile would leak
        header, data = await asyncio.get_running_loop().run_in_executor(
            self._waits, partial(chunk_answer, self.store.book, request, taker=peer))
        slot = data is not None and takes_slot(request)
        share = slot_share(len(data)) if slot else 1.0
        if slot and not await self.slots.take_async(SLOT_WAIT_S, peer, share):
            header, data, slot = self.slots.busy_reply(), None, False
        if slot and (redirect := claim_chunk(self.store.book, request, peer)) is not None:
            self.slots.release(share, peer)
            header, data, slot = redirect, None, False
        if keep:
            header = {**header, "kept": True}
        if data is None:
            await P2P.send_raw_data(msgpack.packb(header), writer)
            return 0
        try:
            await P2P.send_raw_data(msgpack.packb(header), writer)
            if isinstance(data, ChunkFeed):
                await self._pass_on(data, writer)
            else:
                await asyncio.wait_for(P2P.send_raw_data(data, writer), send_deadline(len(data)))
            self.bytes_served += len(data)
            return len(data)
        finally:
            if slot:
                self.slots.release(share, peer)

    async def _pass_on(self, feed: ChunkFeed, writer) -> None:
        """A chunk sent as it arrives here (framed as any payload: its size, then its bytes).
        Raises ChunkCutOff when it fails to arrive whole and verified: the stream is then cut."""

        loop = asyncio.get_running_loop()
        deadline = send_deadline(len(feed))
        writer.write(len(feed).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
        while (piece := await loop.run_in_executor(self._waits, feed.next, deadline)) is not None:
            writer.write(piece)
            await asyncio.wait_for(writer.drain(), deadline)

    def close(self) -> None:
        self._host.close()
        self._waits.shutdown(wait=False, cancel_futures=True)
        self._pushes.shutdown(wait=False, cancel_futures=True)


class WeightClient(RebuildingClient):
    """Fetches versions over hivemind p2p streams."""

    def __init__(self, dht, run_id: str, *, timeout_s: float = 120.0, max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> None:
        self.timeout_s, self.max_payload_bytes = timeout_s, max_payload_bytes
        self._client = StreamClient(dht, handler_name(run_id), thread_name="weight-client")
        self._kept = KeptStreams()
        self.streams_opened = 0  # new streams, for chunk requests (kept ones are used again)

    def _payloads(self, holder, have: int | None, want: int, timeout_s: float | None = None) -> list[bytes]:
        return self._client.run(self._request(holder, {"have": have, "want": want}, have, want),
                                timeout=min(self.timeout_s, timeout_s or self.timeout_s))

    def _single(self, holder, request: dict, size: int, timeout: float,
                sink: Callable[[bytes], None] | None = None) -> bytes:
        return self._client.run(self._request(holder, request, None, request["version"], size, sink),
                                timeout=timeout)[0]

    def tell(self, peer, request: dict, timeout: float) -> dict:
        """`peer`'s answer to a request that brings no payload back (a pushed announcement)."""
        return self._client.run(self._told(peer, request), timeout=timeout)

    async def _told(self, peer_id, request: dict) -> dict:
        reader, writer = await self._client.open(peer_id)
        try:
            await P2P.send_raw_data(msgpack.packb(request), writer)
            size = check_payload_size(int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER), peer_id,
                                      HEADER_LIMIT)
            answer = msgpack.unpackb(await reader.readexactly(size), raw=False)
            return answer if isinstance(answer, dict) else {}
        finally:
            close_stream(writer)

    async def _request(self, peer_id, request: dict, have: int | None, want: int, single: int | None = None,
                       sink: Callable[[bytes], None] | None = None) -> list[bytes]:
        """The payloads a holder sends for `request`: have -> want's, or (`single`) one answer of
        at most that many bytes (its bytes given to `sink` as they come)."""

        async def receive(limit: int, heard: Callable[[bytes], None] | None = None, piece: int = RECEIVE_PIECE_BYTES,
                          cut_off: bool = False) -> bytes:
            # P2P.receive_raw_data would allocate whatever length the holder claims: check it first
            size = check_payload_size(int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER), peer_id, limit)
            try:
                if heard is None:
                    return await reader.readexactly(size)
                parts = []  # in pieces, each one heard of (readexactly holds the whole payload twice at its end too)
                while size > 0:
                    parts.append(await reader.readexactly(min(size, piece)))
                    size -= len(parts[-1])
                    heard(parts[-1])
                return b"".join(parts)
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                if not cut_off:
                    raise
                # a chunk passed on as it arrived there that did not arrive whole (or the holder
                # left: the next request to it will fail)
                raise ChunkCutOff(f"holder {peer_id} cut the chunk off ({type(exc).__name__})") from exc

        keep = single is not None and request.get("op") in ("manifest", "chunk")
        header, reused = None, False
        if keep:
            request = {**request, "keep": True}
            stream = self._kept.take(str(peer_id))
            if stream is not None:
                reader, writer = stream
                reused = True
                try:
                    await P2P.send_raw_data(msgpack.packb(request), writer)
                    raw_header = await receive(HEADER_LIMIT)
                except (asyncio.IncompleteReadError, ConnectionError):  # its server closed it meanwhile: a new one
                    writer.close()
                    reused = False
                except BaseException:
                    close_stream(writer)
                    raise
        if not reused:
            reader, writer = await self._client.open(peer_id)
            self.streams_opened += keep
        done = False
        try:
            if not reused:
                await P2P.send_raw_data(msgpack.packb(request), writer)
                raw_header = await receive(HEADER_LIMIT)
            try:
                header = msgpack.unpackb(raw_header, raw=False)
            except (ValueError, msgpack.UnpackException) as exc:
                raise CorruptVersion(f"holder {peer_id} sent an unreadable header: {exc}") from exc
            if not isinstance(header, dict):
                raise CorruptVersion(f"holder {peer_id} sent a malformed header")
            if header.get("ok") is not True:
                done = True  # a refusal, a redirect, busy: the answer is whole (its stream may be kept)
            refuse_unless_ok(header, peer_id, want)
            if single is not None:
                check_payload_count(header.get("count"), None, want, peer_id)
                answer = [await receive(single, sink, forward_piece_bytes(single), cut_off=request.get("op") == "chunk")]
                done = True
                return answer
            count = check_payload_count(header.get("count"), have, want, peer_id)
            heard = self.on_received
            counted = None if heard is None else (lambda part: heard(len(part)))
            return [await receive(self.max_payload_bytes, counted) for _ in range(count)]
        finally:
            if keep and done and header.get("kept") is True and asyncio.current_task() is not None \
                    and not asyncio.current_task().cancelling():
                self._kept.put(str(peer_id), (reader, writer))
            else:
                close_stream(writer)

    def close(self) -> None:
        try:
            self._client.run(self._kept.close_all(), timeout=5)
        except Exception:  # noqa: BLE001  the loop may be gone already
            pass
        self._client.close()


class KeptStreams:
    """Streams to other peers' weight servers kept open for the next chunk request (used from the
    client's loop thread only): at most POOLED_PER_PEER per peer, POOLED_PEERS peers, each used again
    for POOL_IDLE_S after its last answer."""

    def __init__(self) -> None:
        self._streams: OrderedDict[str, list[tuple[float, object, object]]] = OrderedDict()

    def take(self, peer: str):
        streams = self._streams.get(peer)
        now = time.monotonic()
        while streams:
            kept_at, reader, writer = streams.pop()
            if now - kept_at < POOL_IDLE_S and not reader.at_eof():
                return reader, writer
            writer.close()
        return None

    def put(self, peer: str, stream) -> None:
        streams = self._streams.setdefault(peer, [])
        self._streams.move_to_end(peer)
        if len(streams) >= POOLED_PER_PEER:
            stream[1].close()
            return
        streams.append((time.monotonic(), *stream))
        while len(self._streams) > POOLED_PEERS:
            for _, _, writer in self._streams.popitem(last=False)[1]:
                writer.close()

    async def close_all(self) -> None:
        for streams in self._streams.values():
            for _, _, writer in streams:
                writer.close()
        self._streams.clear()
