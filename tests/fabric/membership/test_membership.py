"""Membership records over both transports (a hivemind DHT, the gRPC registry): peers are listed
with what they announce, vanish a few heartbeats after they stop, and nobody can write another
peer's record or a malformed one."""

import time

import pytest

from benchmarks.waiting import wait_until
from swarm.fabric.membership.records import Heartbeat


def test_records_are_listed_and_expire_after_a_peer_stops(make_fabric):
    # b's records outlive their heartbeat by 30 s: it can only drop out of the listing below by saying it leaves
    a, b, observer = make_fabric(), make_fabric(heartbeat_s=10.0), make_fabric()
    assert a.heartbeat(Heartbeat(role="sampler", model="embedded", version=3, rollouts=7, tokens_per_s=120.5))
    assert b.heartbeat(Heartbeat(role="learner", model="embedded", version=5))

    def listed():
        return {(m.record.role, m.record.version, m.record.peer_id) for m in observer.members()}

    expected = {("sampler", 3, a.peer_id), ("learner", 5, b.peer_id)}
    wait_until(lambda: listed() == expected, 20, f"the members {expected}", every=0.25, logs=lambda: f"listed: {listed()}")
    sampler = next(m for m in observer.members() if m.record.role == "sampler")
    assert sampler.record.rollouts == 7 and sampler.record.tokens_per_s == 120.5 and sampler.record.software
    a.shutdown()  # a stops heartbeating; b goes on: within a few heartbeats only b is listed
    deadline = time.time() + 15
    while time.time() < deadline and len(listed()) != 1:
        b.heartbeat(Heartbeat(role="learner", model="embedded", version=6))
        time.sleep(1.0)
    assert listed() == {("learner", 6, b.peer_id)}
    # b stops: its last record says it is leaving, and it is left out at once (its record has not
    # expired: that takes 30 s)
    assert b.heartbeat(Heartbeat(role="learner", model="embedded", version=6, leaving=True))
    wait_until(lambda: not listed(), 10, "b left out once it says it is leaving", every=0.1, logs=lambda: f"listed: {listed()}")


def record(peer_id, **changes):
    value = dict(role="learner", peer_id=peer_id, model="", model_hash="", version=99, rollouts=0, tokens_per_s=0.0,
                 software="0", time=float(time.time()))
    value.update(changes)
    return value


def write_as(attacker, owner_key: bytes, owner_peer_id: str, value: dict) -> bool:
    """The attacker writes `value` as the record of the peer with `owner_key` / `owner_peer_id`."""
    if attacker.transport == "grpc":
        reply = attacker._call("Heartbeat", {"run_id": attacker.run_id, "peer_id": owner_peer_id, "token": "", "record": value,
                                             "expiry_s": 30.0})
        return reply["ok"]
    from hivemind.utils import get_dht_time

    from swarm.fabric.membership.records import members_key

    return bool(attacker.dht.store(members_key(attacker.run_id, owner_key), subkey=owner_key, value=value, expiration_time=get_dht_time() + 30))


def test_forged_and_malformed_records_are_refused(make_fabric):
    honest, attacker, observer = make_fabric(), make_fabric(), make_fabric()
    assert honest.heartbeat(Heartbeat(role="sampler", version=1))
    wait_until(lambda: len(observer.members()) == 1, 20, "one member listed", every=0.25)
    # another peer's record: hivemind checks the signature against the key in the subkey, the
    # registry the token it gave the owner
    assert not write_as(attacker, honest.public_key, honest.peer_id, record(honest.peer_id))
    # its own record, but values that break the schema
    for bad in (record(attacker.peer_id, role="boss"), record(attacker.peer_id, version=1.5), record(attacker.peer_id, version=-1),
                {"role": "learner"}):
        assert not write_as(attacker, attacker.public_key, attacker.peer_id, bad)
    assert [(m.record.role, m.record.version, m.record.peer_id) for m in observer.members()] == [("sampler", 1, honest.peer_id)]


def test_unreachable_registry_fails_fast_with_a_clear_error():
    from hivemind.utils.crypto import RSAPrivateKey

    from swarm.fabric.grpc.fabric import GrpcFabric
    from swarm.fabric.interface import JoinError

    started = time.time()
    with pytest.raises(JoinError, match="could not join the swarm through the registry at 127.0.0.1:9"):
        GrpcFabric("127.0.0.1:9", "membership-test", RSAPrivateKey(), heartbeat_s=1.0, timeout_s=3)
    assert time.time() - started < 10
