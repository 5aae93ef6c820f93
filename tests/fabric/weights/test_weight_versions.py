"""Policy versions over both transports (real hivemind swarms, real gRPC servers and registry):
4 receivers (one joining late) rebuild 10 versions bit for bit, fetching from each other through
the product's `fetch_from_holders`; a tampered delta is detected and the same call falls back to
the next holder; announcements by keys that are not the run's learners are ignored, and nobody can
announce under a learner's key. (Which holders a sampler asks is `holders_for`'s decision: today
the announcing learner only; here the tests name holders, as a relaying policy would.)"""

import random

import pytest
import torch

from swarm.fabric.weights.follower import fetch_from_holders
from swarm.fabric.weights.versions import VersionStore
from swarm.fabric.weights.delta import CorruptVersion, encode_snapshot, state_hash



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
    def __init__(self, fabric):
        self.fabric = fabric
        self.store = VersionStore(capacity=16)
        self.server = fabric.weight_server(self.store)
        self.client = fabric.weight_client(timeout_s=60)

    @property
    def key(self):
        return self.fabric.public_key


@pytest.fixture
def peers(make_fabric):
    def make():
        return Peer(make_fabric())

    make.transport = make_fabric.transport
    return make


def sync(receiver, learner_keys, learner, others, rng):
    """Read the newest authorised announcement and fetch it: from a peer that already holds it when
    there is one, the learner after it."""
    ann = receiver.fabric.latest_announced(learner_keys)
    if ann is None or receiver.store.latest == ann.version:
        return None
    holding = [h for h in others if h.store.latest is not None and h.store.latest >= ann.version and h is not receiver]
    holders = ([rng.choice(holding).fabric.peer_id] if holding else []) + [ann.peer_id]
    result = fetch_from_holders(receiver.client, holders, ann.version, ann.hash, receiver.store,
                                receiver.fabric.unreachable_errors())
    assert result.version == ann.version and result.bytes > 0 and receiver.store.hashes[ann.version] == ann.hash
    return result.holder


def forge_announcement(volunteer, learner_key: bytes, version: int) -> bool:
    """The volunteer tries to announce under the learner's key (it cannot sign for it)."""
    from swarm.fabric.weights.announcements import RunSampling, VersionAnnouncement

    value = VersionAnnouncement.of(volunteer.fabric.run_id, version, "0" * 64, volunteer.fabric.peer_id, 0.0, RunSampling()).dict()
    if volunteer.fabric.transport == "grpc":
        from swarm.fabric.grpc.common import pack

        payload = pack(value)
        return volunteer.fabric._call("Announce", {"run_id": volunteer.fabric.run_id, "owner": learner_key, "payload": payload,
                                                   "signature": volunteer.fabric.signing_key.sign(payload)})["ok"]
    from hivemind.utils import get_dht_time

    from swarm.fabric.weights.announcements import versions_key

    return bool(volunteer.fabric.dht.store(versions_key(volunteer.fabric.run_id), subkey=learner_key, value=value,
                                           expiration_time=get_dht_time() + 60))


def test_four_receivers_rebuild_ten_versions_bit_for_bit_with_relay(peers):
    rng = random.Random(0)
    learner = peers()
    receivers = [peers() for _ in range(3)]
    keys = [learner.key]
    served_by_receivers = 0
    late = None
    for version, state in enumerate(publish_stream(10)):
        digest = learner.store.add(version, state)
        assert learner.fabric.announce(version, digest)
        if version == 7:
            late = peers()  # joins late
            receivers.append(late)
        for receiver in receivers:
            holder = sync(receiver, keys, learner, receivers, rng)
            served_by_receivers += holder is not None and holder != learner.fabric.peer_id
    assert served_by_receivers > 0  # receivers relayed versions to each other
    expected = learner.store.states[10]
    for receiver in receivers:
        assert receiver.store.latest == 10
        got = receiver.store.states[10]
        assert state_hash(got) == state_hash(expected)
        assert all(torch.equal(got[k].view(torch.int16), expected[k].view(torch.int16)) for k in expected)
    assert 7 not in late.store.deltas  # the late joiner started from a snapshot


def flipped(payload: bytes) -> bytes:
    corrupt = bytearray(payload)
    corrupt[len(corrupt) // 3] ^= 0x55
    return bytes(corrupt)


def test_a_delta_that_does_not_apply_is_followed_by_a_snapshot_not_retried(peers):
    """A receiver whose base is not what the holder's deltas expect asks for a snapshot instead of
    fetching the same useless deltas at every poll."""
    learner, receiver = peers(), peers()
    versions = list(publish_stream(2))
    for v, state in enumerate(versions):
        learner.store.add(v, state)
    learner.store.deltas[2] = flipped(learner.store.deltas[2])
    receiver.store.add(1, versions[1])
    result = fetch_from_holders(receiver.client, [learner.fabric.peer_id], 2, learner.store.hashes[2], receiver.store,
                                receiver.fabric.unreachable_errors())
    assert result.kinds == ["snapshot"]
    assert state_hash(receiver.store.states[2]) == learner.store.hashes[2]


def test_tampered_delta_is_detected_and_fetched_again_from_another_holder(peers):
    learner, liar, receiver = peers(), peers(), peers()
    versions = list(publish_stream(2))
    for v, state in enumerate(versions):
        learner.store.add(v, state)
        liar.store.add(v, state)
    receiver.store.add(1, versions[1])
    liar.store.deltas[2] = flipped(liar.store.deltas[2])
    liar.store._snapshot = (2, flipped(encode_snapshot(versions[2], 2)))  # the snapshot it falls back to is bad too
    digest = learner.store.hashes[2]
    unreachable = receiver.fabric.unreachable_errors()
    with pytest.raises(CorruptVersion):
        fetch_from_holders(receiver.client, [liar.fabric.peer_id], 2, digest, receiver.store, unreachable)
    assert receiver.store.latest == 1  # nothing from the corrupt transfer was kept
    result = fetch_from_holders(receiver.client, [liar.fabric.peer_id, learner.fabric.peer_id], 2, digest, receiver.store,
                                unreachable)
    assert result.holder == learner.fabric.peer_id and result.kinds == ["delta"]  # the liar was skipped
    assert receiver.store.hashes[2] == digest


def test_a_holder_whose_deltas_do_not_verify_is_blamed_even_when_its_snapshot_never_comes(peers):
    """A liar that sends a corrupt delta and then fails the snapshot asked of it instead (here it
    claims not to hold the version; under load it may hang up mid-answer) is reported for the
    corrupt data, not let off as merely unreachable."""
    learner, liar, receiver = peers(), peers(), peers()
    versions = list(publish_stream(2))
    for v, state in enumerate(versions):
        learner.store.add(v, state)
        liar.store.add(v, state)
    receiver.store.add(1, versions[1])
    liar.store.deltas[2] = flipped(liar.store.deltas[2])
    honest_payloads = liar.store.payloads

    def no_snapshot(have, want):
        if have is None:
            raise KeyError(f"version {want} is not held here")
        return honest_payloads(have, want)

    liar.store.payloads = no_snapshot
    blamed = []
    with pytest.raises(CorruptVersion):
        fetch_from_holders(receiver.client, [liar.fabric.peer_id], 2, learner.store.hashes[2], receiver.store,
                           receiver.fabric.unreachable_errors(), on_corrupt=lambda holder, exc: blamed.append(holder))
    assert blamed == [liar.fabric.peer_id]
    assert receiver.store.latest == 1


def test_announcements_by_unauthorised_keys_are_ignored(peers):
    learner, volunteer, receiver = peers(), peers(), peers()
    state = next(publish_stream(0))
    digest = learner.store.add(0, state)
    assert learner.fabric.announce(0, digest)
    assert volunteer.fabric.announce(99, "0" * 64)  # under its own key: stored, but nobody follows it
    ann = receiver.fabric.latest_announced([learner.key])
    assert (ann.version, ann.hash, ann.peer_id) == (0, digest, learner.fabric.peer_id)
    assert receiver.fabric.latest_announced([volunteer.key]).version == 99
    # and no peer can announce under the learner's key
    assert not forge_announcement(volunteer, learner.key, 100)
    assert receiver.fabric.latest_announced([learner.key]).version == 0


def serve_bogus_weights(holder, size: int):
    """Make `holder` answer every weight request with a header promising one payload of `size`
    bytes, and nothing after it."""
    if holder.fabric.transport == "grpc":
        from swarm.fabric.grpc.common import pack

        holder.fabric.server.weight_handler = lambda request, who="", peer="": iter([pack({"ok": True, "sizes": [size]})])
        return None
    import msgpack
    from hivemind.p2p import P2P

    from swarm.fabric.hivemind.loop import HostedStreamHandler
    from swarm.fabric.hivemind.weights import handler_name

    async def bogus(stream_info, reader, writer):
        await P2P.receive_raw_data(reader)
        await P2P.send_raw_data(msgpack.packb({"ok": True, "count": 1}), writer)
        writer.write(size.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))  # then never the bytes
        await writer.drain()

    holder.server.close()  # its honest server gives up the handler name
    return HostedStreamHandler(holder.fabric.dht, handler_name(holder.fabric.run_id), bogus, thread_name="bogus-weights")


def test_a_holder_promising_an_oversized_payload_is_refused_unread_and_skipped(peers):
    from swarm.fabric.weights.delta import MAX_PAYLOAD_BYTES
    from swarm.fabric.weights.versions import OversizedPayload

    learner, liar, receiver = peers(), peers(), peers()
    state = next(publish_stream(0))
    digest = learner.store.add(0, state)
    hosted = serve_bogus_weights(liar, MAX_PAYLOAD_BYTES + 1)
    try:
        unreachable = receiver.fabric.unreachable_errors()
        with pytest.raises(OversizedPayload, match="limit"):
            fetch_from_holders(receiver.client, [liar.fabric.peer_id], 0, digest, receiver.store, unreachable)
        assert receiver.store.latest is None
        result = fetch_from_holders(receiver.client, [liar.fabric.peer_id, learner.fabric.peer_id], 0, digest,
                                    receiver.store, unreachable)
        assert result.holder == learner.fabric.peer_id and receiver.store.hashes[0] == digest
    finally:
        if hosted is not None:
            hosted.close()
