"""Old held versions are rebuilt off the thread that asks (VersionStore.state_now, background_rebuilds.py):
the asking thread applies at most `inline_undo` undo deltas for any held version, an older one comes
from one background thread (newest first, each from the one built before it) and is kept until its
reader comes back; a weight server answers busy (no blame, ask again) for a snapshot of an old version
while it is rebuilt, then serves it, over a real transport."""

import time

import pytest

from swarm.fabric.weights.delta import state_hash
from swarm.fabric.weights.upload_slots import HolderBusy
from swarm.fabric.weights.versions import VersionStore
from tests.fabric.weights.test_held_versions import states


def wait_until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def held_store(n: int, *, inline_undo: int, seed: int = 0) -> tuple[VersionStore, dict[int, str]]:
    store = VersionStore(capacity=n, whole_states=1, cached_states=1, inline_undo=inline_undo)
    hashes = {version: store.add(version, state) for version, state in enumerate(states(n, seed=seed))}
    return store, hashes


def test_the_asking_thread_applies_at_most_the_inline_undo_deltas_and_old_versions_come_from_the_background():
    store, hashes = held_store(12, inline_undo=2)
    newest, oldest = 11, 0
    assert store.rebuild_cost(oldest) == 11
    assert store.state_now(oldest) is None  # at once: its 11 undo deltas are applied behind
    assert store.undo_applied["inline"] == 0
    state = store.state_now(newest - 2)  # 2 undo deltas: in the asking thread
    assert state is not None and state_hash(state) == hashes[newest - 2] and store.undo_applied["inline"] == 2
    wait_until(lambda: store.available_now(oldest))
    state = store.state_now(oldest)
    assert state is not None and state_hash(state) == hashes[oldest]
    assert 9 <= store.undo_applied["background"] <= 11 and store.undo_applied["inline"] == 2
    # whatever version is asked for, in whatever order, the asker applies at most 2 undo deltas itself
    for version in (3, 8, 1, 10, 5, 0, 7, 2):
        before = store.undo_applied["inline"]
        state = store.state_now(version)
        assert store.undo_applied["inline"] - before <= 2
        if state is not None:
            assert state_hash(state) == hashes[version]


def test_a_batch_of_old_versions_costs_one_pass_down_the_chain_and_each_waits_for_its_reader():
    store, hashes = held_store(14, inline_undo=1, seed=2)
    with store.lock:  # (the rebuilder starts once all three are asked for)
        for version in (9, 5, 1):  # asked out of order
            assert store.state_now(version) is None
    # one pass: 13 -> 9 (4 undo deltas), then 9 -> 5 and 5 -> 1 from the version built last, each
    # waiting for its reader before the next is built (keep=1)
    for version in (9, 5, 1):
        wait_until(lambda: store.available_now(version))
        state = store.state_now(version)  # read: the next one may now take its place
        assert state is not None and state_hash(state) == hashes[version]
    wait_until(lambda: not store.behind.busy())
    assert store.undo_applied["background"] == 12 and store.behind.rebuilt == 3
    assert store.undo_applied["inline"] == 0


def test_a_rebuilt_version_released_unread_makes_room_for_the_next_at_once():
    """A version rebuilt for groups that were then dropped (too stale by the time it was ready) would
    hold the rebuilder's one room for HOLD_S (120 s) while other versions wait; released, the next
    version is built at once."""
    from swarm.fabric.weights.background_rebuilds import HOLD_S

    store, hashes = held_store(14, inline_undo=1, seed=3)
    assert store.state_now(9) is None
    wait_until(lambda: store.available_now(9))  # built, and nobody reads it
    assert store.state_now(5) is None  # waits for the room 9 holds
    time.sleep(0.5)
    assert not store.available_now(5) and store.behind.held() == 1
    store.release(9)
    wait_until(lambda: store.available_now(5), timeout_s=HOLD_S / 4)
    state = store.state_now(5)
    assert state is not None and state_hash(state) == hashes[5]
    assert not store.available_now(9)  # its copy is gone: 4 undo deltas from the newest again


def test_a_server_answers_busy_for_an_old_version_being_rebuilt_then_serves_its_snapshot(make_fabric):
    learner_fabric, receiver_fabric = make_fabric(), make_fabric()
    store, hashes = held_store(10, inline_undo=1, seed=4)
    server = learner_fabric.weight_server(store)
    client = receiver_fabric.weight_client(timeout_s=30)
    try:
        with pytest.raises(HolderBusy, match="being rebuilt"):  # at once: no request thread waits for 9 undo deltas
            client.fetch(learner_fabric.peer_id, 0, hashes[0], VersionStore(capacity=4))
        received = VersionStore(capacity=4)
        deadline = time.monotonic() + 60
        while True:  # as a follower does with a busy holder: ask again shortly
            try:
                result = client.fetch(learner_fabric.peer_id, 0, hashes[0], received)
                break
            except HolderBusy:
                assert time.monotonic() < deadline, "never served"
                time.sleep(0.1)
        assert result.kinds == ["snapshot"] and received.hashes[0] == hashes[0]
        assert state_hash(received.states[0]) == hashes[0]
        assert store.undo_applied["inline"] == 0
    finally:
        server.close()
