"""Hostile holders as real processes (tests/helpers/hostile_holder.py), on both transports
(issue 45): a signed membership record whose peer id does not parse and that lists the coming
versions as held stops no sampler (records are data: such a record names no holder, and whatever
one holder raises, the fetch goes on to the next, the learner last); a peer that took every chunk
of the snapshot from the learner and serves them slowly is struck after its first chunks, and a
joining peer gets the snapshot from the learner (the holder also sends one requester to one taker
for at most REDIRECT_SHARE of a payload's chunks). Timing against an honest swarm:
benchmarks/slow_holder.py."""

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.waiting import wait_until
from swarm.fabric.local import LocalFabrics
from swarm.fabric.membership.records import Heartbeat, Member, believable_holds, dialable_peer_id
from swarm.fabric.weights.announcements import Announced
from swarm.fabric.weights.chunked_fetch import ChunkedFetch, ChunkSources
from swarm.fabric.weights.takers import REDIRECT_SHARE
from swarm.fabric.weights.delta import state_hash
from swarm.fabric.weights.follower import fetch_from_holders, holders_for
from swarm.fabric.weights.versions import VersionStore
from tests.fabric.weights.test_chunks import CHUNK, Sampler, versions

RUN = "hostile-holders-test"
HELPER = Path(__file__).parents[2] / "helpers" / "hostile_holder.py"
BAD_ID = "0OIl-not-base58!"


@pytest.fixture(params=["hivemind", "grpc"])
def swarm(request):
    with LocalFabrics(request.param, RUN) as fabrics:
        yield fabrics


def hostile(fabrics, learner, mode: str) -> subprocess.Popen:
    """The hostile peer's process, once it printed "ready"."""
    proc = subprocess.Popen([sys.executable, str(HELPER), "--transport", fabrics.transport, "--peers",
                             ",".join(fabrics.bootstrap.addresses()), "--run-id", RUN, "--learner-key",
                             learner.public_key.hex(), "--mode", mode], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise AssertionError(f"the hostile peer did not start: {line!r}, exit {proc.wait(10)}")
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(10)


def learner_store():
    store = VersionStore()
    store.book.chunk_bytes = CHUNK
    return store


def test_a_record_is_believed_only_with_a_dialable_peer_id_and_no_versions_to_come():
    def record(peer_id, holds):
        return Heartbeat(role="sampler", holds=tuple(holds), relay=True).record(peer_id, 0.0)

    assert dialable_peer_id("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")
    assert dialable_peer_id("0123456789abcdef@127.0.0.1:4000") and dialable_peer_id("127.0.0.1:4000")
    for bad in (BAD_ID, "", "0123456789abcdef@not an address", "a" * 129, "x@h:99999", None, 7):
        assert not dialable_peer_id(bad), bad
    assert believable_holds(record("Qm1", [3, 4]), 5) == {3, 4}
    assert believable_holds(record(BAD_ID, [3, 4]), 5) is None
    assert believable_holds(record("Qm1", [5, 6]), 5) is None  # a version not out yet: none of it is believed
    members = [Member(record("Qm1", [5]), 1e12, b"1"), Member(record(BAD_ID, [5]), 1e12, b"2"),
               Member(record("Qm2", [5, 6]), 1e12, b"3")]
    assert holders_for(Announced(5, "h", "QmL"), members) == ["Qm1", "QmL"]


def test_a_holder_that_cannot_be_parsed_is_skipped_and_struck_and_the_learner_asked(swarm):
    """Asked in spite of everything (a list handed over as is): an id that does not parse raises
    nothing out of a whole fetch or a chunked one; the learner serves the version, and the bad
    holder is heard of as unreachable."""
    learner, sampler = swarm.make(), swarm.make()
    store = learner_store()
    server = learner.weight_server(store)
    v0, _ = versions()
    store.add(0, v0)
    spec = next(s for s in store.chunk_specs(0) if s.kind == "snapshot")
    heard = []
    client = sampler.weight_client()
    try:
        got = fetch_from_holders(client, [BAD_ID, learner.peer_id], 0, store.hashes[0], VersionStore(),
                                 sampler.unreachable_errors(), on_unreachable=lambda peer, exc: heard.append(peer))
        assert got.holder == learner.peer_id and heard == [BAD_ID]
        fetch = ChunkedFetch(client, VersionStore().book, spec, ChunkSources([BAD_ID, learner.peer_id], [sampler.peer_id]),
                             sampler.peer_id, unreachable=sampler.unreachable_errors(), on_corrupt=lambda p, e: None,
                             on_unreachable=lambda peer, exc: heard.append(peer))
        assert fetch.run().payload() == store.payload("snapshot", 0)
        assert BAD_ID in fetch._dead and set(fetch.received) == {learner.peer_id}
    finally:
        client.close()
        server.close()


def test_a_record_with_a_bad_peer_id_listing_the_coming_versions_stops_no_sampler(swarm):
    """The hostile process keeps a signed record in the swarm whose peer id is not one, relaying,
    listing the next 16 versions as held. A following sampler fetches every version the learner
    announces after it, each from the learner, none failing."""
    learner = swarm.make(heartbeat_s=0.5)
    store = learner_store()
    server = learner.weight_server(store)
    sampler = Sampler(swarm.make(heartbeat_s=0.5), learner.public_key, 0)
    v0, v1 = versions()
    states = [v0, v1]
    proc = None
    try:
        store.add(0, v0)
        learner.announce(0, store.hashes[0], recent=dict(store.hashes), chunks=store.chunk_specs(0))
        wait_until(lambda: sampler.reported(0), 60, "version 0 at the sampler")
        proc = hostile(swarm, learner, "record")
        wait_until(lambda: any(1 in m.record.holds and m.record.relay and m.record.peer_id != sampler.fabric.peer_id
                               for m in learner.members()), 30, "the hostile record listed")
        for version in range(1, 5):  # the hostile record lists each of these as held before it is out
            store.add(version, states[version % 2])
            learner.announce(version, store.hashes[version], recent=dict(store.hashes), chunks=store.chunk_specs(version))
            wait_until(lambda: sampler.reported(version), 30, f"version {version} at the sampler")
        assert sampler.follower.last_error is None and sampler.follower._failures == 0
        assert [r.version for r in sampler.results] == [0, 1, 2, 3, 4]
        assert all(set(r.sources or [r.holder]) == {learner.peer_id} for r in sampler.results)
        assert state_hash(sampler.store.states[4]) == store.hashes[4]
    finally:
        if proc is not None:
            stop(proc)
        sampler.close()
        server.close()


def test_a_slow_taker_of_every_chunk_is_struck_and_a_joining_peer_gets_the_snapshot(swarm):
    """The hostile process took every chunk of the snapshot from the learner as a relaying peer, so
    the learner sends later requesters of those chunks to it, and it serves them slowly (512 bytes
    every 0.1 s). A joining peer is sent there for its first chunks, gives up on it within
    SLOW_GRACE_S of the learner's pace, strikes it and takes the rest from the learner: bit for
    bit, with next to nothing from the hostile peer."""
    learner = swarm.make()
    store = learner_store()
    server = learner.weight_server(store)
    v0, _ = versions()
    store.add(0, v0)
    specs = store.chunk_specs(0)
    spec = next(s for s in specs if s.kind == "snapshot")
    learner.announce(0, store.hashes[0], recent=dict(store.hashes), chunks=specs)
    proc = hostile(swarm, learner, "slow")
    joining = swarm.make()
    heard = []
    fetch = ChunkedFetch(joining.weight_client(), VersionStore().book, spec, ChunkSources([learner.peer_id], [joining.peer_id]),
                         joining.peer_id, unreachable=joining.unreachable_errors(), on_corrupt=lambda p, e: None,
                         on_unreachable=lambda peer, exc: heard.append(peer), rng=random.Random(0))
    try:
        taken = store.book.takers.taken(("snapshot", 0, spec.root))
        assert taken == spec.count  # the hostile peer is every chunk's taker
        started = time.monotonic()
        assert fetch.run().payload() == store.payload("snapshot", 0)
        took = time.monotonic() - started
        (slow,) = fetch.slow
        assert slow != learner.peer_id and slow in heard
        assert fetch.received[slow] <= 2 * CHUNK  # at most the chunks of the requests in flight as it was struck
        assert fetch.received[learner.peer_id] >= spec.size - 2 * CHUNK
        assert 1 <= store.book.takers.redirected <= int(spec.count * REDIRECT_SHARE)
        print(f"{swarm.transport}: {spec.size} bytes in {took:.2f}s with the slow taker struck")
    finally:
        stop(proc)
        fetch.client.close()
        server.close()
