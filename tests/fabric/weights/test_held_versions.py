"""Versions held as the newest whole state plus undo deltas: every version within the window is
rebuilt bit for bit (its hash), held bytes stay near one state, chains of deltas span versions a
publisher skipped, and a background Publisher skips and composes when encoding is slower than the
steps while a receiver following what it publishes (over a real transport) always matches it."""

import dataclasses
import threading
import time

import pytest
import torch

from swarm.fabric.weights.delta import CorruptVersion, apply_payload_verified, state_hash
from swarm.fabric.weights.follower import fetch_from_holders
from swarm.fabric.weights.publisher import Publisher, PublisherFailed
from swarm.fabric.weights.undo import encode_undo
from swarm.fabric.weights.versions import VersionStore, snapshot_bytes

SHAPES = {"embed": (512, 96), "layer.0.w": (96, 288), "layer.0.norm": (96,), "layer.1.w": (288, 96)}


def states(n: int, seed: int = 0, changed: float = 0.04):
    """n bf16 states, each with ~`changed` of its elements moved by one step of their bits from the last."""
    gen = torch.Generator().manual_seed(seed)
    state = {k: (torch.randn(s, generator=gen) * 0.05).to(torch.bfloat16) for k, s in SHAPES.items()}
    for _ in range(n):
        yield state
        nxt = {}
        for k, t in state.items():
            bits = t.view(torch.int16).clone()
            mask = torch.rand(t.shape, generator=gen) < changed
            bits[mask] += torch.randint(0, 2, (int(mask.sum()),), generator=gen, dtype=torch.int16) * 2 - 1
            nxt[k] = bits.view(torch.bfloat16)
        state = nxt


def test_every_version_in_the_window_is_rebuilt_bit_for_bit_with_bounded_held_bytes():
    capacity = 17
    store = VersionStore(capacity=capacity, whole_states=1, cached_states=1, delta_budget=0.5)
    expected = {}
    for version, state in enumerate(states(25)):
        expected[version] = state_hash(state)
        assert store.add(version, state) == expected[version]
    held = list(store.states)
    assert held == list(range(25 - capacity, 25))
    size = snapshot_bytes(store.states[24])
    bytes_held = store.held_bytes()
    assert bytes_held["whole"] == size  # one whole state
    assert bytes_held["undo"] + bytes_held["deltas"] < size  # 16 undo deltas and the forward ones kept
    for version in reversed(held):  # newest to oldest: each one a longer chain of undo deltas
        assert state_hash(store.states[version]) == expected[version] == store.hashes[version]
    assert store.held_bytes()["cached"] <= size  # one rebuilt version kept
    with pytest.raises(KeyError):
        store.states[25 - capacity - 1]  # evicted: said so, not rebuilt wrong
    # a snapshot of an old version (served to a peer that asks for it) is that version
    version, state, digest, kind = apply_payload_verified(store.payloads(None, held[0])[0])
    assert (version, kind, digest) == (held[0], "snapshot", expected[held[0]])


def test_a_chain_of_deltas_spans_the_versions_a_publisher_skipped():
    store = VersionStore(capacity=8, whole_states=1)
    published = {}
    for version, state in enumerate(states(9)):
        if version in (0, 3, 4, 8):  # 1, 2 and 5..7 skipped
            published[version] = state
            store.add(version, state)
    assert store.bases == {3: 0, 4: 3, 8: 4}
    chain = store.payloads(0, 8)
    assert len(chain) == 3
    state = published[0]
    for payload, want in zip(chain, (3, 4, 8)):
        version, state, digest, kind = apply_payload_verified(payload, state)
        assert (version, kind, digest) == (want, "delta", state_hash(published[want]))
    with pytest.raises(ValueError, match="not newer"):
        store.add(8, published[8])


def test_a_slow_publisher_skips_and_composes_and_a_receiver_always_matches(make_fabric):
    learner_fabric, receiver_fabric = make_fabric(), make_fabric()
    # the learner holds all 24 versions: on a busy machine few may be skipped, and each announced one is checked below
    learner_store, receiver_store = VersionStore(capacity=24, whole_states=1), VersionStore(capacity=16)
    server = learner_fabric.weight_server(learner_store)
    client = receiver_fabric.weight_client(timeout_s=30)
    announced = []

    def on_published(version, digest):
        with learner_store.lock:
            recent = dict(learner_store.hashes)
        assert learner_fabric.announce(version, digest, recent=recent)
        announced.append(version)

    # 0.3 s a version on top of the encoding, for steps of 0.05 s: most versions are skipped
    publisher = Publisher(learner_store, on_published=on_published, encode_delay_s=0.3)
    trained, kinds = {}, []
    try:
        for version, state in enumerate(states(24, seed=1)):
            trained[version] = state_hash(state)
            if version == 0:
                publisher.publish_now(version, {k: v.clone() for k, v in state.items()})
            else:
                publisher.submit(version, {k: v.clone() for k, v in state.items()})
            ann = receiver_fabric.latest_announced([learner_fabric.public_key])
            if ann is not None and ann.version != receiver_store.latest:
                kinds += fetch_from_holders(client, [ann.peer_id], ann.version, ann.hash, receiver_store,
                                            receiver_fabric.unreachable_errors(), known=ann.recent).kinds
                newest = receiver_store.latest
                assert receiver_store.hashes[newest] == trained[newest] == learner_store.hashes[newest]
            time.sleep(0.05)
        assert publisher.wait(timeout=30)
        assert "delta" in kinds  # deltas across skipped versions, not a snapshot every time
        assert publisher.skipped and announced[-1] == 23 and announced == sorted(announced)
        assert len(announced) + len(publisher.skipped) == 24  # each version published or skipped, once
        for version in announced:
            assert learner_store.hashes[version] == trained[version]
        assert all(learner_store.bases[b] == a for a, b in zip(announced, announced[1:]) if b in learner_store.bases)
        ann = receiver_fabric.latest_announced([learner_fabric.public_key])
        fetch_from_holders(client, [ann.peer_id], ann.version, ann.hash, receiver_store, receiver_fabric.unreachable_errors(),
                           known=ann.recent)
        assert receiver_store.latest == 23 and state_hash(receiver_store.states[23]) == trained[23]
    finally:
        publisher.close()
        server.close()


def test_a_failure_in_the_publisher_thread_reaches_the_training_thread():
    store = VersionStore(capacity=4, whole_states=1)
    first = next(states(1))
    publisher = Publisher(store, on_published=lambda v, d: None)
    try:
        publisher.publish_now(0, first)
        publisher.submit(1, {"embed": first["embed"]})  # other tensor names than version 0: no delta can be encoded
        with pytest.raises(PublisherFailed, match="tensor names differ"):
            publisher.wait(timeout=30)
        with pytest.raises(PublisherFailed):
            publisher.submit(2, first)
        assert store.latest == 0  # nothing half-published
    finally:
        publisher.close()


def test_closing_while_publishing_finishes_the_version_under_way_and_drops_the_waiting_one():
    store = VersionStore(capacity=8, whole_states=1)
    published = []
    publisher = Publisher(store, on_published=lambda v, d: published.append(v), encode_delay_s=0.5)
    gen = states(3)
    publisher.publish_now(0, next(gen))
    publisher.submit(1, next(gen))
    time.sleep(0.1)  # version 1 is under way
    publisher.submit(2, next(gen))  # waits
    closing = threading.Thread(target=publisher.close)
    closing.start()
    closing.join(timeout=10)
    assert not closing.is_alive()
    assert published == [0, 1] and store.latest == 1
    assert not any(t.name == "version-publisher" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(PublisherFailed, match="closed"):
        publisher.submit(3, {})


def test_the_oldest_version_rebuilds_bit_for_bit_and_a_corrupted_undo_delta_is_caught_at_the_end_of_the_chain():
    store = VersionStore(capacity=12, whole_states=1, cached_states=1)
    published = {}
    for version, state in enumerate(states(12, seed=3)):
        published[version] = state
        store.add(version, state)
    oldest = min(store.hashes)
    assert len(store._undo) == 11
    assert state_hash(store.state(oldest)) == state_hash(published[oldest]) == store.hashes[oldest]  # 11 undo deltas
    # an undo delta that names the right versions and hashes but rebuilds other weights (moved once
    # more): every step's header checks pass, and the final hash tells
    def lying(version):
        newer = store._undo[version].newer
        wrong = {k: (v.view(torch.int16) + 1).view(torch.bfloat16) for k, v in published[version].items()}
        return encode_undo(published[newer], wrong, newer=newer, newer_hash=store.hashes[newer], version=version,
                           version_hash=store.hashes[version])

    for version in (oldest, 5):  # the chain's last step; one in the middle
        good = store._undo[version]
        store._undo[version] = lying(version)
        store._cache.clear()
        with pytest.raises(CorruptVersion, match=f"version {oldest} rebuilt through 11 undo deltas does not match its hash"):
            store.state(oldest)
        assert oldest not in store._cache  # nothing wrong is kept
        store._undo[version] = good
    # an undo delta held for the wrong version is caught at its step (its recorded pairing)
    good = store._undo[5]
    store._undo[5] = dataclasses.replace(store._undo[4], newer=6)  # version 4's changes, held as version 5's
    with pytest.raises(CorruptVersion, match="undo delta to version 4 starts from version 6, not from the state"):
        store.state(oldest)
    store._undo[5] = good
    # one that does not decode (a stream cut short) is said so
    name, count, gaps, steps = good.tensors[0]
    store._undo[5] = dataclasses.replace(good, tensors=((name, count, gaps[:-3], steps), *good.tensors[1:]))
    with pytest.raises(CorruptVersion, match="undo delta to version 5 does not decode"):
        store.state(oldest)
    store._undo[5] = good
    assert state_hash(store.state(oldest)) == store.hashes[oldest]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_snapshot_on_the_gpu_is_published_as_the_same_version_as_on_the_host():
    """A GPU learner hands the publisher its weights cast on the GPU; the publisher's thread takes them
    to the host on a stream of its own, after the kernels that made them: the same hash as a host copy,
    though the training thread goes on writing the GPU weights at once."""
    gen = states(2, seed=3)
    store = VersionStore(capacity=4, whole_states=1)
    publisher = Publisher(store, on_published=lambda v, d: None)
    try:
        for version, state in enumerate(gen):
            weights = {k: v.cuda() for k, v in state.items()}
            publisher.submit(version, {k: v.clone() for k, v in weights.items()})
            for v in weights.values():
                v.add_(1)  # the next step, on the default stream
            publisher.wait(timeout=60)
            assert store.hashes[version] == state_hash(state)
    finally:
        publisher.close()


def test_a_receiver_checks_a_deltas_base_against_the_hash_it_verified_and_still_refuses_a_changed_base(monkeypatch):
    """RebuildingClient.rebuild hands the store's verified hash of the base to the apply, which then
    hashes no base (a quarter of an apply at Qwen3-0.6B shape); the chain's later deltas get the hash
    each apply verified. A base changed in place since is still refused: the result's hash differs,
    and nothing is stored."""
    import swarm.fabric.weights.delta_apply as delta_apply
    from swarm.fabric.weights.rebuilding_client import RebuildingClient

    torch.manual_seed(0)
    states = [{"w": torch.randn(64, 33).to(torch.bfloat16), "b": torch.randn(7)}]
    for _ in range(2):
        states.append({k: (v.float() + 2e-3 * torch.randn_like(v.float())).to(v.dtype) for k, v in states[-1].items()})
    learner = VersionStore()
    for version, state in enumerate(states):
        learner.add(version, state)
    hashed = []
    monkeypatch.setattr(delta_apply, "state_hash", lambda state: hashed.append(1) or state_hash(state))

    def receiver():
        store = VersionStore()
        store.add(0, {k: v.clone() for k, v in states[0].items()}, digest=learner.hashes[0], owned=True)
        return store

    store = receiver()
    got = RebuildingClient().rebuild("learner", 0, [learner.deltas[1], learner.deltas[2]], 2, learner.hashes[2], store,
                                     dict(learner.hashes), time.time())
    assert got.kinds == ["delta", "delta"] and hashed == []  # neither base hashed again
    assert all(torch.equal(store.state(2)[k], states[2][k]) for k in states[2]) and store.hashes[2] == learner.hashes[2]

    changed = receiver()
    changed.state(0)["w"].view(-1)[:8] += 1.0  # the held base changed behind the store's back
    with pytest.raises(CorruptVersion, match="does not match its hash"):
        RebuildingClient().rebuild("learner", 0, [learner.deltas[1]], 1, learner.hashes[1], changed, {}, time.time())
    assert changed.latest == 0
