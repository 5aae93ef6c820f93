"""The gRPC registry (swarm bootstrap --transport grpc) against a hostile peer: a signed
announcement of another run is refused (and ignored by samplers), a NaN or infinite expiry is
refused, and announcements under throwaway keys cannot swell a sampler's reply."""

import math

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from swarm.fabric.grpc_common import owner_key, pack
from swarm.fabric.grpc_registry import Registry
from swarm.fabric.records import VersionAnnouncement
from swarm.fabric.versions import newest_authorised


def announcement(key, run_id: str, version: int, expiry_s=60.0) -> dict:
    payload = pack(VersionAnnouncement(run_id=run_id, version=version, hash="a" * 64, peer_id="127.0.0.1:1", time=0.0).dict())
    return {"run_id": run_id, "owner": owner_key(key), "payload": payload, "signature": key.sign(payload), "expiry_s": expiry_s}


def test_an_announcement_of_another_run_is_refused_and_ignored():
    registry, learner = Registry(), RSAPrivateKey()
    replay = announcement(learner, "run-a", 40)
    replay["run_id"] = "run-b"  # run A's signed announcement, sent into run B
    reply = registry.announce(replay)
    assert not reply["ok"] and "is for run 'run-a', not 'run-b'" in reply["reason"]
    assert registry.announce(announcement(learner, "run-b", 3))["ok"]  # run B's own, older number, still welcome
    # and a sampler ignores another run's announcement even if some registry passed it on
    items = [(owner_key(learner), VersionAnnouncement(run_id="run-a", version=40, hash="a" * 64, peer_id="x", time=0.0).dict())]
    assert newest_authorised(items, [owner_key(learner)], "run-b") is None


@pytest.mark.parametrize("expiry", [math.nan, math.inf, -1.0, 0.0, "soon"])
def test_records_and_announcements_need_a_finite_positive_expiry(expiry):
    registry = Registry()
    assert not registry.announce(announcement(RSAPrivateKey(), "r", 1, expiry_s=expiry))["ok"]
    record = dict(role="sampler", peer_id="127.0.0.1:5", model="", model_hash="", version=0, rollouts=0, tokens_per_s=0.0,
                  software="0", time=0.0)
    reply = registry.heartbeat({"run_id": "r", "peer_id": "127.0.0.1:5", "token": "", "record": record, "expiry_s": expiry})
    assert not reply["ok"] and "expiry" in reply["reason"]
    assert registry.list_members({"run_id": "r"})["members"] == []


def test_throwaway_keys_cannot_swell_a_samplers_reply():
    registry, learner = Registry(), RSAPrivateKey()
    assert registry.announce(announcement(learner, "r", 7))["ok"]
    for _ in range(40):
        assert registry.announce(announcement(RSAPrivateKey(), "r", 99))["ok"]
    everything = registry.list_versions({"run_id": "r"})["versions"]
    asked = registry.list_versions({"run_id": "r", "owners": [owner_key(learner)]})["versions"]
    assert len(everything) == 41 and [v["owner"] for v in asked] == [owner_key(learner)]
