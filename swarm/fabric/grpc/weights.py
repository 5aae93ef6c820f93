"""Policy versions over gRPC: a peer's weight server (whole versions and chunks, within its upload
slots) and the client that fetches from holders' servers (grpc/fabric.py wires both into
`GrpcFabric`). Every request is signed; the server knows its caller by key."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
import msgpack

from swarm.fabric.grpc.common import CHUNK_BYTES, RequestSigner, pack, unpack
from swarm.fabric.grpc.server import WEIGHTS
from swarm.fabric.weights.announcement_push import PUSH_OP, answer_push
from swarm.fabric.weights.chunks import ChunkCutOff, ChunkFeed, chunk_answer, forward_piece_bytes, slot_share, takes_slot
from swarm.fabric.weights.delta import MAX_PAYLOAD_BYTES, CorruptVersion
from swarm.fabric.weights.upload_slots import HolderBusy, UploadSlots
from swarm.fabric.weights.rebuilding_client import RebuildingClient, refuse_unless_ok
from swarm.fabric.weights.versions import (
    HEADER_LIMIT,
    check_payload_count,
    check_payload_size,
    send_deadline,
)

if TYPE_CHECKING:
    from swarm.fabric.grpc.server import GrpcPeerServer


class GrpcWeightServer:
    """Serves the versions in `store`: a header (the size of each payload), then chunks."""

    def __init__(self, server: GrpcPeerServer, store, *, slots: int | None = None) -> None:
        self.store, self.served, self.bytes_served, self._server = store, 0, 0, server
        self.slots = UploadSlots(slots)
        server.weight_handler = self._handle

    def _handle(self, request: dict, who: str = "", peer: str = ""):
        if request.get("op") == PUSH_OP:  # a learner's announcement
            yield pack(answer_push(self.store.book.on_pushed, request))
            return
        if "op" in request:  # a manifest or a chunk
            yield from self._chunk(request, who, peer)
            return
        have, want = request.get("have"), request.get("want")
        if not _is_int(want):
            yield pack({"ok": False, "reason": f"want must be a version number, not {type(want).__name__}"})
            return
        if not self.slots.take():  # the slot first: a request that is refused costs no encoding
            yield pack(self.slots.busy_reply())
            return
        try:  # a receiver that goes away ends this generator (GeneratorExit): the slot is freed all the same
            try:
                payloads = self.store.payloads(have if _is_int(have) else None, want)
            except HolderBusy as exc:  # an old version being rebuilt: ask again shortly, no blame
                yield pack({"ok": False, "busy": True, "reason": f"busy: {exc}", "count": 0})
                return
            except (KeyError, TypeError, ValueError) as exc:
                yield pack({"ok": False, "reason": str(exc)})
                return
            yield pack({"ok": True, "sizes": [len(p) for p in payloads]})
            for payload in payloads:
                yield from self._pieces(payload)
            self.served += 1
        finally:
            self.slots.release()

    def _chunk(self, request: dict, who: str, peer: str):
        header, data = chunk_answer(self.store.book, request, self.slots, who, peer)
        if data is None:
            yield pack(header)
            return
        try:
            yield pack(header)
            if isinstance(data, ChunkFeed):  # on its way here: passed on as it arrives (ChunkCutOff: cut)
                deadline = send_deadline(len(data))
                yield from self._counted(iter(lambda: data.next(deadline), None))
            else:  # in pieces a receiver can pass on as they come
                yield from self._pieces(data, forward_piece_bytes(len(data)))
        finally:
            if takes_slot(request):
                self.slots.release(slot_share(len(data)), who)

    def _pieces(self, payload: bytes, size: int = CHUNK_BYTES):
        """A payload in messages of at most `size` bytes (`_counted`)."""
        return self._counted(payload[start : start + size] for start in range(0, len(payload), size))

    def _counted(self, pieces):
        """`pieces`, counted as they go (a receiver that has all it wants closes the call before
        this generator runs on)."""
        for piece in pieces:
            self.bytes_served += len(piece)
            yield piece

    def close(self) -> None:
        self._server.weight_handler = None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class GrpcWeightClient(RebuildingClient):
    """Fetches versions from holders' gRPC servers, each request signed. What a holder says is
    checked before anything is read: at most the payloads `have -> want` takes, each at most
    `max_payload_bytes`, sent in chunks of at most CHUNK_BYTES that add up to exactly that size.
    `channels`: the fabric's pool of channels to other peers (grpc.server.Channels)."""

    def __init__(self, channels, signer: RequestSigner, *, timeout_s: float = 120.0,
                 max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> None:
        self._channels, self._signer, self.timeout_s, self.max_payload_bytes = channels, signer, timeout_s, max_payload_bytes

    def _payloads(self, holder: str, have: int | None, want: int, timeout_s: float | None = None) -> list[bytes]:
        return self._call(holder, {"have": have, "want": want}, have, want, min(self.timeout_s, timeout_s or self.timeout_s))

    def _single(self, holder, request: dict, size: int, timeout: float, sink=None) -> bytes:
        return self._call(holder, request, None, request["version"], timeout, single=size, sink=sink)[0]

    def tell(self, peer: str, request: dict, timeout: float) -> dict:
        """`peer`'s answer to a request that brings no payload back (a pushed announcement)."""
        body = pack(request)
        call = self._channels.get(peer).stream_stream(WEIGHTS, request_serializer=None, response_deserializer=None)
        messages = call(iter([body]), timeout=timeout, metadata=self._signer.metadata(WEIGHTS, body))
        try:
            first = next(messages, None)
            if first is None or len(first) > HEADER_LIMIT:
                return {}
            answer = unpack(first)
            return answer if isinstance(answer, dict) else {}
        finally:
            messages.cancel()

    def _call(self, holder: str, request: dict, have: int | None, want: int, timeout: float,
              single: int | None = None, sink=None) -> list[bytes]:
        body = pack(request)
        call = self._channels.get(holder).stream_stream(WEIGHTS, request_serializer=None, response_deserializer=None)
        messages = call(iter([body]), timeout=timeout, metadata=self._signer.metadata(WEIGHTS, body))
        try:
            sizes = self._sizes(holder, have, want, next(messages, None), single)
            try:
                return [self._payload(holder, messages, size, single, sink) for size in sizes]
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.ABORTED and request.get("op") == "chunk":
                    raise ChunkCutOff(f"holder {holder} cut the chunk off: {exc.details()}") from exc
                raise
        finally:
            messages.cancel()  # a refused transfer stops the holder's sending as well

    def _sizes(self, holder: str, have: int | None, want: int, first: bytes | None, single: int | None = None) -> list[int]:
        if first is None:
            raise CorruptVersion(f"holder {holder} sent no header")
        if len(first) > HEADER_LIMIT:
            raise CorruptVersion(f"holder {holder} sent a header of {len(first)} bytes (at most {HEADER_LIMIT})")
        try:
            header = unpack(first)
        except (ValueError, msgpack.UnpackException) as exc:
            raise CorruptVersion(f"holder {holder} sent an unreadable header: {exc}") from exc
        if not isinstance(header, dict):
            raise CorruptVersion(f"holder {holder} sent a malformed header")
        refuse_unless_ok(header, holder, want)
        sizes = header.get("sizes")
        check_payload_count(len(sizes) if isinstance(sizes, list) else None, have, want, holder)
        limit = self.max_payload_bytes if single is None else single
        return [check_payload_size(size, holder, limit) for size in sizes]  # all, before reading any

    def _payload(self, holder: str, messages, size: int, single: int | None = None, sink=None) -> bytes:
        parts, got = [], 0
        while got < size:
            chunk = next(messages, None)
            if chunk is None:
                raise CorruptVersion(f"holder {holder} ended the transfer {size - got} bytes short of a payload")
            if not chunk or len(chunk) > CHUNK_BYTES or got + len(chunk) > size:
                raise CorruptVersion(f"holder {holder} sent a chunk of {len(chunk)} bytes at byte {got} of a {size}-byte "
                                     f"payload (chunks are 1..{CHUNK_BYTES} bytes and end where the payload does)")
            parts.append(chunk)
            got += len(chunk)
            if sink is not None:
                sink(chunk)
            if self.on_received is not None and single is None:
                self.on_received(len(chunk))
        return b"".join(parts)  # a wrong content fails the hash check

    def close(self) -> None:
        pass
