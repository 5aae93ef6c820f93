"""Policy versions over real hivemind swarms: 4 receivers (one joining late) rebuild 10 versions
bit for bit, relaying to each other; a tampered delta is detected and fetched again from another
holder; announcements by keys that are not the run's learners are ignored."""

import random

import pytest
import torch

from swarm.fabric.dht import start_dht
from swarm.fabric.versions import VersionStore, WeightClient, WeightServer, announce, latest_announced
from swarm.fabric.weight_delta import CorruptVersion, state_hash

RUN = "weights-test"


def publish_stream(n):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    yield {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}
    for _ in range(n):
        model(torch.randn(8, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        yield {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}


class Peer:
    def __init__(self, dht, validator):
        self.dht, self.validator = dht, validator
        self.store = VersionStore(capacity=16)
        self.server = WeightServer(dht, RUN, self.store)
        self.client = WeightClient(dht, RUN, timeout_s=60)

    def close(self):
        self.client.close()
        self.server.close()
        self.dht.shutdown()


@pytest.fixture
def peers():
    made = []

    def make(initial=()):
        peer = Peer(*start_dht(RUN, initial_peers=list(initial)))
        made.append(peer)
        return peer

    yield make
    for peer in made:
        peer.close()


def addr(peer):
    return [str(m) for m in peer.dht.get_visible_maddrs()]


def sync(receiver, learner_keys, holders, rng):
    """What a sampler does: read the newest authorised announcement, fetch from a holder."""
    ann = latest_announced(receiver.dht, RUN, learner_keys)
    if ann is None or receiver.store.latest == ann.version:
        return None
    candidates = [h for h in holders if h.store.latest is not None and h.store.latest >= ann.version and h is not receiver]
    holder = rng.choice(candidates)
    receiver.client.fetch(holder.dht.peer_id, ann.version, ann.hash, receiver.store)
    return holder


def test_four_receivers_rebuild_ten_versions_bit_for_bit_with_relay(peers):
    rng = random.Random(0)
    learner = peers()
    receivers = [peers(addr(learner)) for _ in range(3)]
    keys = [learner.validator.local_public_key]
    served_by_receivers = 0
    late = None
    for version, state in enumerate(publish_stream(10)):
        digest = learner.store.add(version, state)
        assert announce(learner.dht, RUN, learner.validator.local_public_key, version, digest)
        if version == 7:
            late = peers(addr(receivers[0]))  # joins late, through a receiver
            receivers.append(late)
        for receiver in receivers:
            holder = sync(receiver, keys, [learner, *receivers], rng)
            served_by_receivers += holder is not None and holder is not learner
    assert served_by_receivers > 0  # receivers relayed versions to each other
    expected = learner.store.states[10]
    for receiver in receivers:
        assert receiver.store.latest == 10
        got = receiver.store.states[10]
        assert state_hash(got) == state_hash(expected)
        assert all(torch.equal(got[k].view(torch.int16), expected[k].view(torch.int16)) for k in expected)
    assert 7 not in late.store.deltas  # the late joiner started from a snapshot


def test_tampered_delta_is_detected_and_fetched_again_from_another_holder(peers):
    learner = peers()
    liar = peers(addr(learner))
    receiver = peers(addr(learner))
    versions = list(publish_stream(2))
    for v, state in enumerate(versions):
        learner.store.add(v, state)
        liar.store.add(v, state)
    receiver.store.add(1, versions[1])
    corrupt = bytearray(liar.store.deltas[2])
    corrupt[len(corrupt) // 3] ^= 0x55
    liar.store.deltas[2] = bytes(corrupt)
    digest = learner.store.hashes[2]
    with pytest.raises(CorruptVersion):
        receiver.client.fetch(liar.dht.peer_id, 2, digest, receiver.store)
    assert receiver.store.latest == 1  # nothing from the corrupt transfer was kept
    receiver.client.fetch(learner.dht.peer_id, 2, digest, receiver.store)
    assert receiver.store.hashes[2] == digest


def test_announcements_by_unauthorised_keys_are_ignored(peers):
    learner = peers()
    volunteer = peers(addr(learner))
    receiver = peers(addr(learner))
    state = next(publish_stream(0))
    digest = learner.store.add(0, state)
    assert announce(learner.dht, RUN, learner.validator.local_public_key, 0, digest)
    assert announce(volunteer.dht, RUN, volunteer.validator.local_public_key, 99, "0" * 64)
    ann = latest_announced(receiver.dht, RUN, [learner.validator.local_public_key])
    assert (ann.version, ann.hash, ann.peer_id) == (0, digest, learner.dht.peer_id.to_base58())
    # and no peer can announce under the learner's key
    assert not announce(volunteer.dht, RUN, learner.validator.local_public_key, 100, "0" * 64)
    assert latest_announced(receiver.dht, RUN, [learner.validator.local_public_key]).version == 0
