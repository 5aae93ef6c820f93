"""Chunk requests over hivemind share streams (issue 44): a requester that says `keep` is answered
on a stream its holder keeps open for the next request, so a chunked fetch opens a stream per
worker, not per chunk; a kept stream its holder closed meanwhile is replaced by a new one, and a
stream carrying anything but manifest and chunk requests is answered once and ended."""

import asyncio
import random
import time

import msgpack
import pytest
from hivemind.p2p import P2P

import swarm.fabric.hivemind.weights as hivemind_weights
from swarm.fabric.hivemind.loop import StreamClient
from swarm.fabric.hivemind.weights import handler_name
from swarm.fabric.local import LocalFabrics
from swarm.fabric.weights.chunked_fetch import SHARED_WORKERS, WHOLE_WORKERS, ChunkedFetch, ChunkSources
from swarm.fabric.weights.chunks import chunk_request
from swarm.fabric.weights.versions import VersionStore
from tests.fabric.weights.test_chunks import CHUNK, versions

RUN = "kept-streams-test"


@pytest.fixture
def holder_and_requester():
    with LocalFabrics("hivemind", RUN) as fabrics:
        holder, requester = fabrics.make(), fabrics.make()
        store = VersionStore()
        store.book.chunk_bytes = CHUNK
        store.add(0, versions()[0])
        server = holder.weight_server(store)
        try:
            yield holder, requester, store, next(s for s in store.chunk_specs(0) if s.kind == "snapshot")
        finally:
            server.close()


def test_a_chunked_fetch_opens_a_stream_per_worker_not_per_chunk(holder_and_requester):
    holder, requester, store, spec = holder_and_requester
    client = requester.weight_client()
    try:
        fetch = ChunkedFetch(client, VersionStore().book, spec, ChunkSources([holder.peer_id], []), requester.peer_id,
                             unreachable=requester.unreachable_errors(), on_corrupt=lambda p, e: None, rng=random.Random(0))
        assert fetch.run().payload() == store.payload("snapshot", 0)
        assert spec.count > 50  # 65 chunks and a manifest ...
        assert client.streams_opened <= WHOLE_WORKERS + SHARED_WORKERS + 1  # ... over a few streams
    finally:
        client.close()


def test_a_kept_stream_its_holder_closed_is_replaced(holder_and_requester, monkeypatch):
    holder, requester, store, spec = holder_and_requester
    monkeypatch.setattr(hivemind_weights, "KEEP_IDLE_S", 0.2)  # the holder closes a kept stream idle this long
    monkeypatch.setattr(hivemind_weights, "POOL_IDLE_S", 60.0)  # ... which the requester would still use
    client = requester.weight_client()
    try:
        first = client.piece(holder.peer_id, spec, 0)
        assert client.streams_opened == 1
        time.sleep(1.0)
        again = client.piece(holder.peer_id, spec, 1)
        assert (first, again) == (store.payload("snapshot", 0)[:CHUNK], store.payload("snapshot", 0)[CHUNK:2 * CHUNK])
        assert client.streams_opened == 2  # the closed one was replaced, no error surfaced
        assert client.piece(holder.peer_id, spec, 2) and client.streams_opened == 2  # and the new one kept
    finally:
        client.close()


def test_a_kept_stream_carries_chunk_requests_only(holder_and_requester):
    holder, requester, store, spec = holder_and_requester
    raw = StreamClient(requester.dht, handler_name(RUN), thread_name="kept-test")

    async def exchange():
        reader, writer = await raw.open(holder.peer_id)
        answers = []
        try:
            for request in ({**chunk_request(spec, 0, 0.0), "keep": True}, {"have": None, "want": 0},
                            {**chunk_request(spec, 1, 0.0), "keep": True}):
                await P2P.send_raw_data(msgpack.packb(request), writer)
                size = int.from_bytes(await asyncio.wait_for(reader.readexactly(P2P.HEADER_LEN), 5), P2P.BYTEORDER)
                header = msgpack.unpackb(await reader.readexactly(size), raw=False)
                answers.append(header)
                if header.get("ok"):
                    await reader.readexactly(int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER))
        except (ConnectionError, EOFError, asyncio.TimeoutError):  # ended, or never read again
            answers.append("ended")
        finally:
            writer.close()
        return answers

    try:
        first, second, third = raw.run(exchange(), timeout=30)
        assert first["ok"] and first["kept"] is True
        assert not second["ok"] and "chunk requests only" in second["reason"]  # a whole version: not on a kept stream
        assert third == "ended"
    finally:
        raw.close()
