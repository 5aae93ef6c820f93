"""The whole-version fallback reaches the learner within a bounded time (issue 45, round two): a
real relay process (tests/helpers/hostile_holder.py --mode stall) holds the announced version,
lists it as held in its relaying record, and stalls every whole-version request; a following
sampler asks it first (relays before the learner), gives it `relay_deadline` of the version's
size instead of the client's whole 120 s, strikes it and gets the version from the learner."""

import random
import time

import pytest

from benchmarks.waiting import wait_until
from swarm.fabric.local import LocalFabrics
from swarm.fabric.weights.follower import RELAY_CAP_S, VersionFollower, relay_deadline
from swarm.fabric.weights.versions import VersionStore
from swarm.staleness import SecondsDelay
from tests.fabric.weights.test_chunks import versions
from tests.fabric.weights.test_hostile_holders import hostile, learner_store, stop

RUN = "hostile-holders-test"  # the hostile helper's run (test_hostile_holders.hostile names it)
pytestmark = pytest.mark.slow


def test_a_relay_gets_a_deadline_by_the_versions_size_capped_well_below_the_clients_timeout():
    assert relay_deadline(0) == pytest.approx(5.0)
    assert 5.0 < relay_deadline(20 * 1024 * 1024) < RELAY_CAP_S  # a 20 MB version: 5 s at 4 MiB/s, plus the grace
    assert relay_deadline(1_500_000_000) == RELAY_CAP_S == relay_deadline(None)  # a whole model: capped
    assert RELAY_CAP_S <= 120.0 / 4


@pytest.mark.parametrize("transport", ["hivemind", "grpc"])
def test_a_stalling_relay_is_struck_and_the_version_comes_from_the_learner_within_the_bound(transport):
    with LocalFabrics(transport, RUN) as swarm:
        learner = swarm.make(heartbeat_s=0.5)
        store = learner_store()
        server = learner.weight_server(store)
        v0, _ = versions()
        store.add(0, v0)
        learner.announce(0, store.hashes[0], recent=dict(store.hashes), chunks=store.chunk_specs(0))
        proc = hostile(swarm, learner, "stall")
        fabric, got, results = swarm.make(heartbeat_s=0.5), VersionStore(), []
        follower = None
        try:
            relays = lambda: [m.record.peer_id for m in fabric.members()  # noqa: E731
                              if 0 in m.record.holds and m.record.relay and m.record.peer_id != learner.peer_id]
            wait_until(lambda: relays(), 30, "the stalling relay's record")
            relay = relays()[0]
            started = time.monotonic()
            # whole versions only (no chunks): the fallback under test
            follower = VersionFollower(fabric, got, [learner.public_key], SecondsDelay.parse("none"), random.Random(0),
                                       echo=lambda m: None, on_fetch=results.append, poll_s=0.5, chunked=False)
            # the client's own timeout is 120 s: a relay given all of it would keep the version away that long
            # (and its record: the follower tells on_fetch once the version is held, a moment after the store has it)
            wait_until(lambda: got.latest == 0 and results, 60, "version 0 at the sampler")
            elapsed = time.monotonic() - started
            bound = relay_deadline(next(s for s in store.chunk_specs(0) if s.kind == "snapshot").size)
            assert results[0].holder == learner.peer_id and results[0].version == 0
            assert relay in follower.shunned()  # asked first, missed its deadline: struck
            assert got.hashes[0] == store.hashes[0]
            print(f"{transport}: version from the learner {elapsed:.1f} s after the sampler started "
                  f"(relay deadline {bound:.1f} s, client timeout {follower.client.timeout_s:.0f} s)")
        finally:
            if follower is not None:
                follower.close()
            stop(proc)
            server.close()
