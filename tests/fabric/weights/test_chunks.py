"""Versions in verifiable chunks (swarm/fabric/weights/chunks.py, chunked_fetch.py): the manifest and its
root, a partial payload served while it fills, a holder's answers; then real swarms on loopback,
over both transports, where three samplers share a snapshot and a delta out in stripes (the
learner uploads about one copy), every one rebuilds the version bit for bit, and a peer that
serves a corrupt chunk is struck while the chunk comes from another holder. One chunked fetch
against real holders, case by case: test_chunked_fetch.py."""

import random
import threading
import time

import pytest
import torch

from benchmarks.waiting import wait_until
from swarm.fabric.weights.chunks import (
    DEFAULT_CHUNK_BYTES,
    DIGEST_BYTES,
    MAX_WAIT_S,
    MIN_AUTO_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    TARGET_CHUNKS,
    ChunkBook,
    ChunkSpec,
    Partial,
    chunk_answer,
    chunk_bytes_for,
    chunk_request,
    claim_chunk,
    parse_chunk_request,
    slot_share,
    spec_of,
)
import swarm.fabric.weights.chunked_fetch as chunked_fetch
import swarm.fabric.weights.versions as versions_module
from swarm.fabric.weights.sharer_view import SharerView
from swarm.fabric.weights.follower import VersionFollower
from swarm.fabric.membership.pulse import Pulse
from swarm.fabric.membership.records import Heartbeat
from swarm.fabric.weights.announcements import RunSampling, VersionAnnouncement
from swarm.fabric.weights.upload_slots import UploadSlots
from swarm.fabric.weights.versions import VersionStore
from swarm.fabric.weights.delta import CorruptVersion, state_hash
from swarm.staleness import SecondsDelay
from tests.helpers.wan_weights import corrupting

CHUNK = MIN_CHUNK_BYTES


def payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def test_a_manifest_is_checked_against_the_root_and_each_chunk_against_the_manifest():
    data = payload(3 * CHUNK + 100)
    spec, manifest = spec_of("snapshot", 4, data, CHUNK)
    assert spec.count == 4 and len(manifest) == 4 * DIGEST_BYTES
    assert ChunkSpec.parse(spec.token) == spec
    digests = spec.digests(manifest, "h")
    with pytest.raises(CorruptVersion, match="root"):
        spec.digests(manifest[:-1] + bytes([manifest[-1] ^ 1]), "h")
    with pytest.raises(CorruptVersion):
        spec.digests(manifest[:-DIGEST_BYTES], "h")
    partial = Partial(spec, manifest, digests)
    last = data[3 * CHUNK:]
    assert not partial.put(3, last[:-1] + bytes([last[-1] ^ 1]))  # a flipped bit is not kept
    assert not partial.put(3, data[:CHUNK])  # nor another chunk in its place
    assert partial.missing == 4 and partial.feed(3) is None
    for i in range(4):
        assert partial.put(i, data[i * CHUNK:(i + 1) * CHUNK])
    assert partial.complete and partial.payload() == data


@pytest.mark.parametrize("token", [
    "delta:1:0:4096:" + "0" * 64,  # empty
    "delta:1:100:16:" + "0" * 64,  # chunks below the minimum
    "other:1:100:4096:" + "0" * 64,
    "delta:1:100:4096:" + "0" * 63,
    "delta:1:100000000000:4096:" + "0" * 64,  # more chunks than a manifest may list
])
def test_malformed_or_unbounded_chunk_specs_are_refused(token):
    with pytest.raises(ValueError):
        ChunkSpec.parse(token)


def test_an_announcement_keeps_only_its_own_versions_well_formed_chunk_specs():
    spec, _ = spec_of("delta", 3, payload(5000), CHUNK)
    other, _ = spec_of("snapshot", 2, payload(5000), CHUNK)
    ann = VersionAnnouncement.of("run", 3, "a" * 64, "peer", 0.0, RunSampling(), chunks=[spec, other])
    assert ann.chunk_specs == {"delta": spec}  # a spec of another version is not announced with this one
    assert VersionAnnouncement.parse_obj({**ann.dict(), "chunks": []}).chunk_specs == {}


def test_an_announcement_names_a_bounded_list_of_sharers_in_its_order_that_followers_read_back():
    from pydantic.v1 import ValidationError

    from swarm.fabric.weights.announcements import MAX_ANNOUNCED_SHARERS
    from swarm.fabric.weights.announcements import newest_authorised

    many = [f"peer-{i:03d}" for i in range(MAX_ANNOUNCED_SHARERS + 10)] + ["peer-001"]
    ann = VersionAnnouncement.of("run", 3, "a" * 64, "learner", 0.0, RunSampling(), sharers=reversed(many))
    # deduplicated, bounded, in the order named (a chain's: swarm.fabric.membership.link_judge)
    assert ann.sharers == list(dict.fromkeys(reversed(many)))[:MAX_ANNOUNCED_SHARERS]
    assert ann.sharers[0] == "peer-001" and ann.sharers[1] == f"peer-{MAX_ANNOUNCED_SHARERS + 9:03d}"
    assert newest_authorised([(b"key", ann.dict())], [b"key"], "run").sharers == tuple(ann.sharers)
    for bad in ([""], ["x" * 129], sorted(set(many)), [3]):  # empty, too long, too many, not a string
        with pytest.raises(ValidationError):
            VersionAnnouncement.parse_obj({**ann.dict(), "sharers": bad})


def test_a_partial_payload_is_served_as_it_fills_and_a_waiting_request_gets_the_chunk_when_it_arrives():
    data = payload(2 * CHUNK)
    spec, manifest = spec_of("delta", 7, data, CHUNK)
    book = ChunkBook(lambda kind, version: None, CHUNK)
    book.on_unheld = lambda kind, version: unheld.append((kind, version))
    unheld = []
    assert book.lookup("delta", 7, spec.root, 0, 0.7) is None  # neither held nor on its way
    assert unheld == [("delta", 7)]  # heard once, however long the request waited
    partial = book.begin(spec, manifest, spec.digests(manifest, "h"))
    assert book.lookup("delta", 7, spec.root, None, 0.0) == manifest
    assert unheld == [("delta", 7)]  # a payload on its way is not news
    assert book.lookup("delta", 7, "0" * 64, None, 0.0) is None  # another root: another payload
    partial.put(0, data[:CHUNK])
    assert book.lookup("delta", 7, spec.root, 0, 0.0) == data[:CHUNK]
    got = {}
    waiter = threading.Thread(target=lambda: got.update(chunk=book.lookup("delta", 7, spec.root, 1, 5.0)))
    started = time.monotonic()
    waiter.start()
    time.sleep(0.3)
    partial.put(1, data[CHUNK:])
    waiter.join(5)
    assert got["chunk"] == data[CHUNK:] and 0.25 < time.monotonic() - started < 4
    book.end(partial)
    assert book.lookup("delta", 7, spec.root, 0, 0.0) is None


def test_a_complete_payload_is_served_only_under_its_own_root():
    data = payload(CHUNK + 10)
    book = ChunkBook(lambda kind, version: data if (kind, version) == ("snapshot", 2) else None, CHUNK)
    spec = book.spec("snapshot", 2)
    assert spec == spec_of("snapshot", 2, data, CHUNK)[0]
    assert book.lookup("snapshot", 2, spec.root, 1, 0.0) == data[CHUNK:]
    assert book.lookup("snapshot", 2, "f" * 64, 1, 0.0) is None  # an honest holder that encoded otherwise
    assert book.lookup("snapshot", 2, spec.root, 5, 0.0) is None  # past the last chunk


def test_a_holder_answers_bad_requests_and_busy_slots_without_sending_anything():
    data = payload(CHUNK)
    book = ChunkBook(lambda kind, version: data, CHUNK)
    spec = book.spec("delta", 1)
    for bad in ({"op": "chunk"}, {**chunk_request(spec, 0, 0), "index": -1}, {**chunk_request(spec, 0, 0), "root": "x"},
                {**chunk_request(spec, 0, 0), "wait": "forever"}, {**chunk_request(spec, 0, 0), "kind": "weights"}):
        with pytest.raises(ValueError):
            parse_chunk_request(bad)
        header, sent = chunk_answer(book, bad, UploadSlots(1))
        assert header["ok"] is False and sent is None
    slots = UploadSlots(1)
    header, sent = chunk_answer(book, chunk_request(spec, 0, 0), slots)
    # a chunk holds its share of a slot, by its bytes: 4 KiB of a 1 MiB slot
    assert header == {"ok": True, "count": 1, "sizes": [CHUNK]} and sent == data
    assert slots.active == slot_share(CHUNK) == CHUNK / DEFAULT_CHUNK_BYTES
    assert not slots.take()  # a whole transfer does not fit beside it
    slots.release(slot_share(CHUNK))
    assert slots.take() and slots.active == 1
    started = time.monotonic()
    header, sent = chunk_answer(book, chunk_request(spec, 0, 0), slots)  # queues for the slot, then gives up
    assert header.get("busy") and sent is None and time.monotonic() - started >= 1.5
    slots.release()
    assert slots.active == 0


def test_upload_slots_count_shares_of_a_slot_exactly():
    slots = UploadSlots(2)
    assert all(slots.take(0.0, "a", 0.25) for _ in range(8))  # 8 quarter-slot chunks in flight
    assert not slots.take(0.0, "b", 0.25) and slots.refused == 1
    slots.release(0.25)
    assert slots.take(0.0, "b", 0.25)
    odd = [slot_share(n) for n in (1, 4097, 300_001, 1 << 20, 5 << 20)]  # a last chunk has any size
    assert odd[-2:] == [1.0, 1.0]  # a chunk larger than DEFAULT_CHUNK_BYTES holds one whole slot
    for _ in range(8):
        slots.release(0.25)
    for share in odd:
        assert slots.take(0.0, "c", share)
        slots.release(share)
    assert slots.active == 0 and not slots._given
    for bad in (0.0, -1.0, 1.5):
        with pytest.raises(ValueError, match="share"):
            slots.take(0.0, "d", bad)


def test_chunk_sizes_follow_the_payload_so_a_small_one_is_cut_in_many_chunks():
    assert chunk_bytes_for(98_600_000) == DEFAULT_CHUNK_BYTES  # a 100 MB snapshot: 1 MiB chunks
    for size in (9_700_000, 3_000_000, 33_000_000, 2_000_000_000):
        chunk = chunk_bytes_for(size)
        assert chunk & (chunk - 1) == 0 and MIN_AUTO_CHUNK_BYTES <= chunk <= DEFAULT_CHUNK_BYTES
        count = -(-size // chunk)
        assert count >= TARGET_CHUNKS and (count < 2 * TARGET_CHUNKS + 1 or chunk == DEFAULT_CHUNK_BYTES)
    assert chunk_bytes_for(1000) == MIN_AUTO_CHUNK_BYTES and chunk_bytes_for(10**7, CHUNK) == CHUNK
    data = payload(300_000)
    book = ChunkBook(lambda kind, version: data)  # what a learner announces, what a relay computes alike
    assert book.spec("delta", 3) == spec_of("delta", 3, data, chunk_bytes_for(len(data)))[0]
    assert book.spec("delta", 3).chunk_bytes == MIN_AUTO_CHUNK_BYTES


def test_a_whole_holder_sends_a_chunks_later_requesters_to_the_relay_it_sent_it_to(monkeypatch):
    """A complete payload's chunk goes once to a relaying requester; the next requesters of that
    chunk within REDIRECT_S are sent there, unless they force (that relay failed them); a
    requester that does not relay is never a target, and a payload being received is never
    redirected (its owner is what others ask)."""
    import swarm.fabric.weights.chunks as chunks
    import swarm.fabric.weights.takers as takers

    data = payload(3 * CHUNK)
    book = ChunkBook(lambda kind, version: data if version == 4 else None, CHUNK)
    spec = book.spec("snapshot", 4)
    slots = UploadSlots(4)

    def ask(index, taker, **flags):
        header, sent = chunk_answer(book, chunk_request(spec, index, 0, **flags), slots, taker, taker)
        if sent is not None:
            slots.release(slot_share(len(sent)))
        return header, sent

    header, sent = ask(0, "quiet")  # does not relay: sent, and not remembered
    assert header["ok"] and sent == data[:CHUNK]
    assert ask(0, "a", relays=True)[1] == data[:CHUNK]
    assert ask(0, "a", relays=True)[1] == data[:CHUNK]  # its own chunk again (a transfer it lost)
    header, sent = ask(0, "b", relays=True)
    assert header["redirect"] == "a" and header["ok"] is False and sent is None
    assert ask(1, "b", relays=True)[1] == data[CHUNK:2 * CHUNK]  # another chunk: b is its taker
    assert ask(1, "a", relays=True)[0]["redirect"] == "b"
    header, sent = ask(0, "b", relays=True, force=True)  # a failed b: sent, and b takes over
    assert sent == data[:CHUNK] and ask(0, "c")[0]["redirect"] == "b"
    assert slots.active == 0 and book.takers.redirected == 3  # a redirect takes no slot
    monkeypatch.setattr(takers, "REDIRECT_S", 0.0)
    time.sleep(0.01)
    assert ask(0, "c")[1] == data[:CHUNK]  # past the window: sent again
    # the claim made once a slot is taken (where the transports take it) decides races
    request = chunk_request(spec, 2, 0, relays=True)
    monkeypatch.setattr(takers, "REDIRECT_S", 30.0)
    assert chunks.claim_chunk(book, request, "a") is None and chunks.claim_chunk(book, request, "b")["redirect"] == "a"
    partial_spec, manifest = spec_of("delta", 9, data, CHUNK)
    partial = book.begin(partial_spec, manifest, partial_spec.digests(manifest, "x"))
    assert partial.put(0, data[:CHUNK])
    for taker in ("a", "b"):
        header, sent = chunk_answer(book, chunk_request(partial_spec, 0, 0, relays=True), None, taker, taker)
        assert sent == data[:CHUNK]
    with pytest.raises(ValueError, match="force and relays"):
        parse_chunk_request({**chunk_request(spec, 0, 0), "force": "yes"})


def test_an_event_loop_waiting_for_a_slot_is_not_blocked_and_a_cancelled_waiter_takes_none():
    import asyncio

    slots = UploadSlots(1)
    assert slots.take()

    async def scenario():
        waiter = asyncio.create_task(slots.take_async(5.0))
        ticks = 0
        for _ in range(5):  # the loop keeps running while the waiter polls
            await asyncio.sleep(0.02)
            ticks += 1
        waiter.cancel()
        try:
            await waiter
        except asyncio.CancelledError:
            pass
        slots.release()  # the slot frees after the waiter went away: it must not be taken by it
        assert await slots.take_async(0.0)
        refused = await asyncio.create_task(slots.take_async(0.1))
        return ticks, refused

    ticks, refused = asyncio.run(scenario())
    assert ticks == 5 and refused is False and slots.active == 1 and slots.refused == 1


def test_a_freed_upload_slot_goes_to_the_requester_served_least_whoever_asked_first():
    """The learner hands its slots out by how many each requester got since it was last idle, so
    every stripe owner's chunks come at the same pace (sync and event-loop waiters alike)."""
    import asyncio

    slots = UploadSlots(1)
    assert slots.take(0.0, "a")
    order = []
    first = threading.Thread(target=lambda: slots.take(10.0, "a") and order.append("a"))
    first.start()
    wait_until(lambda: len(slots._waiting) == 1, 5, "a's second request waiting")

    async def late_b():
        assert await slots.take_async(10.0, "b")
        order.append("b")

    second = threading.Thread(target=lambda: asyncio.run(late_b()))
    second.start()
    wait_until(lambda: len(slots._waiting) == 2, 5, "b waiting too")
    slots.release()  # b, served none so far, goes before a, which asked first
    wait_until(lambda: order == ["b"], 5, "b served")
    slots.release()
    wait_until(lambda: order == ["b", "a"], 5, "a served next")
    first.join(5)
    second.join(5)
    slots.release()
    assert slots.active == 0 and not slots._given  # idle: the next busy spell starts even


def _manifest_and_digests(spec, data):
    manifest = spec_of(spec.kind, spec.version, data, spec.chunk_bytes)[1]
    return manifest, spec.digests(manifest, "x")


def test_a_holder_crowded_with_waiting_requests_answers_busy_not_missing(monkeypatch):
    """Past MAX_WAITERS waiting requests, or past a request's wait, a chunk still on its way is
    answered busy (ask again shortly), never "not held", which a fetch counts against its owner;
    held chunks are served."""
    import swarm.fabric.weights.chunks as chunks

    monkeypatch.setattr(chunks, "MAX_WAITERS", 1)
    data = payload(2 * CHUNK)
    spec, manifest = spec_of("delta", 5, data, CHUNK)
    book = ChunkBook(lambda kind, version: None, CHUNK)
    partial = book.begin(spec, manifest, spec.digests(manifest, "x"))
    assert partial.put(0, data[:CHUNK])
    waiter = threading.Thread(target=lambda: book.lookup("delta", 5, spec.root, 1, 3.0))
    waiter.start()
    wait_until(lambda: book._waiters == 1, 5, "a request waiting for chunk 1")
    header, sent = chunk_answer(book, chunk_request(spec, 1, 3.0))
    assert header["ok"] is False and header.get("busy") and sent is None
    header, sent = chunk_answer(book, chunk_request(spec, 0, 3.0))
    assert header["ok"] is True and sent == data[:CHUNK]  # what is here is served, crowded or not
    other, _ = spec_of("delta", 6, data, CHUNK)
    header, _ = chunk_answer(book, chunk_request(other, 0, 3.0))
    assert header["ok"] is False and not header.get("busy")  # a payload not fetched here: not held
    assert partial.put(1, data[CHUNK:])
    waiter.join(5)
    monkeypatch.setattr(chunks, "MAX_WAITERS", 32)
    late, _ = spec_of("delta", 7, payload(2 * CHUNK, seed=1), CHUNK)
    book.begin(late, *_manifest_and_digests(late, payload(2 * CHUNK, seed=1)))
    header, sent = chunk_answer(book, chunk_request(late, 1, 0.2))  # on its way, not here within the wait
    assert header["ok"] is False and header.get("busy") and sent is None


# -----------------------------------------------------------------------------------------------
# real swarms on loopback

def versions():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.Tanh(), torch.nn.Linear(512, 128))
    v0 = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 128)).pow(2).mean().backward()
    opt.step()
    return v0, {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}


class Sampler:
    def __init__(self, fabric, learner_key: bytes, index: int):
        self.fabric, self.store = fabric, VersionStore()
        self.store.book.chunk_bytes = CHUNK  # as the learner's: a payload held whole is served under its root
        self.server = fabric.weight_server(self.store)
        self.results = []
        self.lookups, self.lookups_at_fetch = 0, []  # membership lookups, in all and by each fetch's end
        listing = fabric.members

        def members():
            self.lookups += 1
            return listing()

        fabric.members = members
        self.pulse = Pulse(self.beat, 0.5)
        self.follower = VersionFollower(fabric, self.store, [learner_key], SecondsDelay.parse("none"),
                                        random.Random(index), echo=lambda m: None, on_fetch=self.fetched, poll_s=0.2)

    def beat(self):
        with self.store.lock:
            holds = tuple(self.store.states)
        self.fabric.heartbeat(Heartbeat(role="sampler", version=max(holds, default=0), holds=holds, relay=True))

    def reported(self, version: int) -> bool:
        """The version is held and its fetch was reported: the follower sets the store's latest
        before it calls on_fetch, so a test reading `results` waits for this, not for the store."""
        return self.store.latest == version and bool(self.results) and self.results[-1].version == version

    def fetched(self, result):
        self.results.append(result)
        self.lookups_at_fetch.append(self.lookups)
        self.pulse.poke()

    def close(self):
        self.follower.close()
        self.pulse.close()
        self.server.close()


def share_out(make_fabric, corrupt: bool, order=lambda named: named):
    """A learner and three samplers (the one whose peer id sorts first, the head of their chain,
    serving corrupt chunks when `corrupt`): the snapshot of version 0 and the delta to version 1
    in chunks. Returns (learner store, its
    server, its peer id, the samplers, payload sizes and the sharers named in version 1's
    announcement). The learner names the delta's sharers as the learner peer does (SharerView),
    in the order `order` gives them."""
    learner_fabric = make_fabric(heartbeat_s=0.5)
    store = VersionStore()
    store.book.chunk_bytes = CHUNK
    server = learner_fabric.weight_server(store)
    samplers = [Sampler(make_fabric(heartbeat_s=0.5), learner_fabric.public_key, i) for i in range(3)]
    if corrupt:
        head = min(samplers, key=lambda s: s.fabric.peer_id)
        head.store.book.lookup = corrupting(head.store.book.lookup)
    wait_until(lambda: sum(m.record.relay for m in learner_fabric.members()) == 3, 30, "three relaying samplers")
    v0, v1 = versions()
    sizes = {}
    view = SharerView(learner_fabric)
    for version, state in ((0, v0), (1, v1)):
        view.publishing(version)
        store.add(version, state)
        specs = store.chunk_specs(version)
        sizes[version] = {s.kind: s.size for s in specs}
        sizes["sharers"] = order(view.announced(version, specs))
        learner_fabric.announce(version, store.hashes[version], recent=dict(store.hashes), chunks=specs,
                                sharers=sizes["sharers"])
        wait_until(lambda: all(s.reported(version) for s in samplers), 90, f"version {version} everywhere")
        # the next payload is shared out only among peers whose records say they hold this one
        wait_until(lambda: all(version in m.record.holds for m in learner_fabric.members() if m.record.role == "sampler"),
                   30, "records listing the version")
    view.close()
    return store, server, learner_fabric.peer_id, samplers, sizes


def test_samplers_share_a_version_out_in_chunks_and_rebuild_it_bit_for_bit(make_fabric):
    store, server, learner, samplers, sizes = share_out(make_fabric, corrupt=False)
    try:
        assert sizes[0]["snapshot"] > 50 * CHUNK and sizes[1]["delta"] > 10 * CHUNK  # many chunks each
        # the learner named the delta's sharers, so no sampler looked the members up for it
        assert sizes["sharers"] == sorted(s.fabric.peer_id for s in samplers)
        assert all(s.lookups_at_fetch[1] == s.lookups_at_fetch[0] >= 1 for s in samplers)
        for sampler in samplers:
            assert state_hash(sampler.store.states[1]) == store.hashes[1]
            assert [r.kinds for r in sampler.results] == [["snapshot"], ["delta"]]
            assert all(r.sources for r in sampler.results)  # both came in chunks
        # every sampler took chunks from the others (its stripes), so the learner sent about one copy
        for kind in (0, 1):
            assert sum(any(p != learner for p in s.results[kind].sources) for s in samplers) >= 2
        assert server.bytes_served < 2 * (sizes[0]["snapshot"] + sizes[1]["delta"]) + 64 * 1024
    finally:
        for sampler in samplers:
            sampler.close()
        server.close()


def test_samplers_make_their_chain_in_the_order_the_learner_named_them(make_fabric):
    """The learner names a delta's sharers in its chain's order (slow links last:
    swarm.fabric.membership.link_judge); every sampler follows that order, not its own sort of the ids."""
    store, server, learner, samplers, sizes = share_out(make_fabric, corrupt=False, order=lambda named: named[::-1])
    try:
        by_id = {s.fabric.peer_id: s for s in samplers}
        assert sizes["sharers"] == sorted(by_id, reverse=True)
        chain = [by_id[p].results[1] for p in sizes["sharers"]]
        assert all(r.kinds == ["delta"] for r in chain)
        assert all(state_hash(s.store.states[1]) == store.hashes[1] for s in samplers)  # bit for bit
        size = sizes[1]["delta"]
        assert chain[0].sources.get(learner, 0) > 0.8 * size  # the head: from the learner
        for before, after in zip(sizes["sharers"], chain[1:]):  # each of the others: from the one named before it
            if before not in after.passed_over:  # (unless a CPU stall made that one look far slower, and it left it: by design)
                assert after.sources.get(before, 0) > 0.8 * size, after.sources
        assert sum(not r.passed_over for r in chain[1:]) >= len(chain) - 2, [r.passed_over for r in chain]
    finally:
        for sampler in samplers:
            sampler.close()
        server.close()


@pytest.mark.parametrize("plan", ["chain", "stripes"])
def test_a_corrupt_chunk_is_fetched_again_from_another_holder_and_its_sender_struck(make_fabric, plan, monkeypatch):
    """Along a chain only the peer after the corrupt one asks it for chunks (and then passes it
    over); with stripes every peer does."""
    if plan == "stripes":
        monkeypatch.setattr(chunked_fetch, "CHAIN_MAX", 1)
    store, server, _, samplers, _ = share_out(make_fabric, corrupt=True)
    try:
        samplers.sort(key=lambda s: s.fabric.peer_id)
        bad = samplers[0].fabric.peer_id
        askers = samplers[1:2] if plan == "chain" else samplers[1:]
        for sampler in samplers[1:]:
            assert state_hash(sampler.store.states[1]) == store.hashes[1]  # bit for bit all the same
            assert all(bad not in r.sources and r.sources for r in sampler.results)  # in chunks, none of them its
        for sampler in askers:
            assert sampler.follower._is_shunned(bad) and sampler.follower._is_struck(bad)  # not asked for a while
    finally:
        for sampler in samplers:
            sampler.close()
        server.close()


def test_a_follower_asked_for_a_version_it_has_not_seen_looks_at_the_announcements_at_once(make_fabric):
    """A sampler that started on a new version asks its stripes' owners for their chunks at once:
    an owner polling every minute is nudged by the request, fetches the version and serves the
    chunk within the request's wait, instead of a poll later."""
    learner = make_fabric()
    store = VersionStore()
    store.book.chunk_bytes = CHUNK
    server = learner.weight_server(store)
    follower_fabric, got = make_fabric(), VersionStore()
    follower_server = follower_fabric.weight_server(got)
    follower = VersionFollower(follower_fabric, got, [learner.public_key], SecondsDelay.parse("none"), random.Random(0),
                               echo=lambda m: None, poll_s=60.0)
    try:
        v0, v1 = versions()
        store.add(0, v0)
        learner.announce(0, store.hashes[0], recent=dict(store.hashes), chunks=store.chunk_specs(0))
        follower.nudge("snapshot", 0)  # (its first look may have come before the announcement)
        wait_until(lambda: got.latest == 0, 30, "version 0 at the follower")
        store.add(1, v1)
        delta = next(s for s in store.chunk_specs(1) if s.kind == "delta")
        learner.announce(1, store.hashes[1], recent=dict(store.hashes), chunks=[delta])
        start, end = delta.bounds(2)  # served within the request's wait, else KeyError (not held)
        assert learner.weight_client().piece(follower_fabric.peer_id, delta, 2, MAX_WAIT_S) == store.deltas[1][start:end]
        wait_until(lambda: got.latest == 1, 30, "version 1 at the follower")
        assert state_hash(got.states[1]) == store.hashes[1]
    finally:
        follower.close()
        follower_server.close()
        server.close()


def test_a_learner_announces_the_delta_spec_at_once_and_the_snapshot_spec_once_computed():
    v0, v1 = versions()
    store = VersionStore()
    store.book.chunk_bytes = CHUNK
    store.add(0, v0)
    store.add(1, v1)
    quick = store.chunk_specs(1, quick=True)
    assert [spec.kind for spec in quick] == ["delta"] and quick[0].size == len(store.deltas[1])
    full = store.chunk_specs(1)
    assert [spec.kind for spec in full] == ["delta", "snapshot"]
    assert store.chunk_specs(1, quick=True) == full  # cached now
    assert store.payload("snapshot", 0) is None  # an older version's snapshot is not encoded for whoever asks


def test_a_learner_holds_the_snapshot_back_until_its_delta_went_out_or_for_a_while(monkeypatch):
    v0, v1 = versions()
    store = VersionStore()
    store.book.chunk_bytes = CHUNK
    store.add(0, v0)
    assert store.snapshot_due(0)  # no delta to it: new samplers need the snapshot at once
    store.add(1, v1)
    delta = store.chunk_specs(1, quick=True)[0]
    assert not store.snapshot_due(1)
    for index in range(delta.count):
        assert not store.snapshot_due(1)  # part of the delta went out: the learner is still needed for the rest
        assert claim_chunk(store.book, chunk_request(delta, index, 0.0, relays=True), f"sampler{index % 3}") is None
    assert store.snapshot_due(1)  # every chunk went to a relaying peer once
    store.add(2, versions()[0])
    monkeypatch.setattr(versions_module, "SNAPSHOT_DEFER_S", 0.0)
    assert store.snapshot_due(2)  # held back no longer than this
