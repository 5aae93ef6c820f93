"""Cut-through within a chunk (swarm/fabric/weights/chunks.py: Partial.receiving, ChunkFeed): a chunk a
relaying peer receives is passed on as its bytes arrive, its last byte only once the whole chunk
verified there; a chunk that does not arrive whole or verified is cut off at every requester. First
on a ChunkBook alone, then over the wire between real peers of each transport on loopback."""

import threading
import time

import pytest

from benchmarks.waiting import wait_until
from swarm.fabric.weights.chunks import ChunkBook, ChunkCutOff, ChunkFeed, spec_of
from swarm.fabric.weights.versions import VersionStore
from tests.fabric.weights.test_chunks import CHUNK, payload


def test_a_chunk_on_its_way_is_passed_on_as_it_arrives_and_its_last_byte_only_once_it_verified():
    data = payload(4 * CHUNK)
    spec, manifest = spec_of("delta", 7, data, 2 * CHUNK)
    book = ChunkBook(lambda kind, version: None, 2 * CHUNK)
    partial = book.begin(spec, manifest, spec.digests(manifest, "h"))
    good = [data[:2 * CHUNK], data[2 * CHUNK:]]
    sink = partial.receiving(0)
    assert partial.receiving(0) is None  # one request at a time passes a chunk on
    feed = book.lookup("delta", 7, spec.root, 0, 0.0)
    assert isinstance(feed, ChunkFeed) and len(feed) == 2 * CHUNK
    sink(good[0][:100])
    assert feed.next(1.0) == good[0][:100]
    sink(good[0][100:])
    assert feed.next(1.0) == good[0][100:-1]  # all but the last byte: not verified yet
    last = {}
    waiter = threading.Thread(target=lambda: last.update(piece=feed.next(5.0)))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive(), "the last byte went out before the chunk verified"
    assert partial.put(0, good[0])
    partial.received(0)
    waiter.join(5)
    assert last["piece"] == good[0][-1:] and feed.next(0.0) is None

    # a chunk that arrives corrupt: its requesters never get its last byte
    bad = bytearray(good[1])
    bad[5] ^= 1
    sink = partial.receiving(1)
    feed = book.lookup("delta", 7, spec.root, 1, 0.0)
    sink(bytes(bad))
    assert feed.next(1.0) == bytes(bad[:-1])
    assert not partial.put(1, bytes(bad))
    partial.received(1)
    with pytest.raises(ChunkCutOff):
        feed.next(1.0)
    # ... nor when another request brings the chunk whole meanwhile: what it was given does not match
    sink = partial.receiving(1)
    feed = book.lookup("delta", 7, spec.root, 1, 0.0)
    sink(bytes(bad[:100]))
    assert feed.next(1.0) == bytes(bad[:100])
    assert partial.put(1, good[1])
    with pytest.raises(ChunkCutOff):
        feed.next(1.0)
    partial.received(1)
    assert book.lookup("delta", 7, spec.root, 1, 0.0) == good[1]  # a later requester gets the chunk kept
    assert partial.complete and partial.payload() == data


def test_a_relay_passes_a_chunk_on_over_the_wire_as_it_arrives_and_cuts_it_off_when_it_does_not_verify(make_fabric):
    """Over each transport: a peer asking a relay for a chunk still arriving there receives its
    bytes as they come (heard by its own sink before the relay holds the whole chunk), the last one
    once the relay verified the chunk; and a chunk that arrives corrupt at the relay is cut off at
    the asker (ChunkCutOff: ask again, no blame), which never holds it."""
    relay, asker = make_fabric(), make_fabric()
    store = VersionStore()
    server = relay.weight_server(store)
    client = asker.weight_client()
    size = 1 << 16  # two pieces of FORWARD_PIECE_BYTES each
    data = payload(2 * size, seed=3)
    spec, manifest = spec_of("delta", 3, data, size)
    partial = store.book.begin(spec, manifest, spec.digests(manifest, "h"))
    good = [data[:size], data[size:]]

    def ask(index: int, heard: list, out: dict) -> threading.Thread:
        def run():
            try:
                out["data"] = client.piece(relay.peer_id, spec, index, 5.0, sink=heard.append)
            except Exception as exc:  # noqa: BLE001  checked below
                out["error"] = exc
        thread = threading.Thread(target=run)
        thread.start()
        return thread

    try:
        heard, out = [], {}
        sink = partial.receiving(0)
        thread = ask(0, heard, out)
        sink(good[0][:40000])
        wait_until(lambda: sum(map(len, heard)) > 0, 10, "the first bytes at the asker")
        assert not out and not partial.have[0]  # they came before the relay held the chunk
        sink(good[0][40000:])
        time.sleep(0.3)
        assert thread.is_alive() and not out, "the asker had the chunk before the relay verified it"
        assert partial.put(0, good[0])
        partial.received(0)
        thread.join(10)
        assert out == {"data": good[0]} and b"".join(heard) == good[0]

        bad = bytearray(good[1])
        bad[-100] ^= 1
        heard, out = [], {}
        sink = partial.receiving(1)
        thread = ask(1, heard, out)
        sink(bytes(bad))
        wait_until(lambda: sum(map(len, heard)) > 0, 10, "the corrupt chunk's first bytes at the asker")
        assert not partial.put(1, bytes(bad))
        partial.received(1)
        thread.join(10)
        assert isinstance(out.get("error"), ChunkCutOff), out
        assert sum(map(len, heard)) < size  # never the whole chunk
        assert partial.put(1, good[1])  # brought whole by another request: asked again, it comes
        assert client.piece(relay.peer_id, spec, 1, 0.0) == good[1]
    finally:
        client.close()
        server.close()
