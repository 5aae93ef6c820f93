"""The run owner's revocation list over gRPC (`swarm authorize --revoke --transport grpc`): on a
real registry process, the CLI publishes the list signed by the owner's key; a sampler's lookup
reads it back (its signature checked again) and refuses what a revoked learner pushes, as it does
over hivemind. The registry takes a list only from the key that signed it, never an older one,
and only a bounded number from one address."""

import random
import subprocess
import sys
import time

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.waiting import wait_until
from swarm.cli.launcher import LocalSwarm
from swarm.config.learner_keys import encode_learner_key
from swarm.fabric.grpc.common import Caller
from swarm.fabric.grpc.fabric import GrpcFabric
from swarm.fabric.grpc.registry import MAX_REVOCATION_LISTS_PER_IP, Registry
from swarm.fabric.membership.authority import issue, key_fingerprint, revoke
from swarm.fabric.membership.identity import load_or_create_signing_key
from swarm.fabric.membership.records import Heartbeat
from swarm.fabric.signing import owner_id, owner_key
from swarm.fabric.weights.announcement_push import push_request
from swarm.fabric.weights.announcements import RunSampling, VersionAnnouncement
from swarm.fabric.weights.follower import VersionFollower
from swarm.fabric.weights.versions import VersionStore
from swarm.staleness import SecondsDelay
from tests.helpers.processes import kill_started

RUN = "revoked-grpc"
SWARM = [sys.executable, "-m", "swarm.cli"]


@pytest.fixture
def swarm(tmp_path):
    local = LocalSwarm(tmp_path, run_id=RUN, transport="grpc")
    try:
        yield local
    finally:
        kill_started(local)  # only the processes this test started, by pid


def certified_push(learner_key, certificate: str, version: int) -> dict:
    ann = VersionAnnouncement.of(RUN, version, "a" * 64, "k@127.0.0.1:1", time.time(), RunSampling(), {}, (), certificate)
    return push_request(learner_key, ann)


@pytest.mark.slow
def test_a_revocation_published_over_grpc_is_read_back_and_a_revoked_learners_push_refused(swarm, tmp_path):
    addr = swarm.start_bootstrap()
    owner_file = tmp_path / "owner.sign.key"
    owner = load_or_create_signing_key(owner_file)
    learner_key = RSAPrivateKey()
    certificate = issue(owner, RUN, owner_key(learner_key)).token

    sampler = GrpcFabric(addr, RUN, RSAPrivateKey(), heartbeat_s=5.0)
    follower = VersionFollower(sampler, VersionStore(), [owner_key(owner)], SecondsDelay.parse("none"), random.Random(0),
                               echo=lambda m: None, poll_s=60.0)
    try:
        assert sampler.heartbeat(Heartbeat(role="sampler", version=0))  # the run is up at the registry
        assert sampler.revoked([owner_key(owner)]) == frozenset()
        assert follower.pushed(certified_push(learner_key, certificate, 5))  # certified: taken

        # a stranger's list, under its own key, names the certified learner: it is not the owner's
        stranger_file = tmp_path / "stranger.sign.key"
        load_or_create_signing_key(stranger_file)
        stranger = subprocess.run([*SWARM, "authorize", "--owner-key-file", str(stranger_file), "--run-id", RUN, "--revoke",
                                   encode_learner_key(owner_key(learner_key)), "--peers", addr, "--transport", "grpc"],
                                  capture_output=True, text=True, timeout=120)
        assert stranger.returncode == 0, stranger.stderr
        assert sampler.revoked([owner_key(owner)]) == frozenset()
        assert follower.pushed(certified_push(learner_key, certificate, 6))

        # the owner's list, through the CLI as a user runs it
        done = subprocess.run([*SWARM, "authorize", "--owner-key-file", str(owner_file), "--run-id", RUN, "--revoke",
                               encode_learner_key(owner_key(learner_key)), "--peers", addr, "--transport", "grpc"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "published" in done.stdout
        fingerprint = key_fingerprint(owner_key(learner_key))
        wait_until(lambda: fingerprint in sampler.revoked([owner_key(owner)]), 10, "the owner's revocation list")
        assert not follower.pushed(certified_push(learner_key, certificate, 7))  # revoked: refused

        # the registry unreachable: a one-line error, not a traceback
        gone = subprocess.run([*SWARM, "authorize", "--owner-key-file", str(owner_file), "--run-id", RUN, "--revoke",
                               encode_learner_key(owner_key(RSAPrivateKey())), "--peers", "127.0.0.1:1", "--transport", "grpc"],
                              capture_output=True, text=True, timeout=120)
        assert gone.returncode == 1 and "Traceback" not in gone.stderr and "registry" in gone.stderr, gone.stderr
    finally:
        follower.close()
        sampler.shutdown()


def caller_of(key, ip: str = "10.0.0.1") -> Caller:
    owner = owner_key(key)
    return Caller(owner=owner, key=owner_id(owner), peer=f"{owner_id(owner)}@{ip}:1", run_id=RUN, ip=ip)


def test_the_registry_takes_a_list_only_from_its_owner_never_an_older_one_and_a_bounded_number_per_ip():
    registry = Registry()
    owner, other = RSAPrivateKey(), RSAPrivateKey()
    learner = owner_key(RSAPrivateKey())
    first = revoke(owner, RUN, [learner], now=10.0)
    # no run at the registry yet: refused, with what to do
    assert "once the run is up" in registry.revoke({"run_id": RUN, "token": first.token}, caller_of(owner))["reason"]
    registry.heartbeat({"run_id": RUN, "record": Heartbeat(role="sampler").record(caller_of(other).peer, time.time()).dict(),
                        "expiry_s": 30.0}, caller_of(other))
    # posted by another key than the one that signed it: refused
    assert "owner key that signed it" in registry.revoke({"run_id": RUN, "token": first.token}, caller_of(other))["reason"]
    assert registry.revoke({"run_id": RUN, "token": "garbage.garbage"}, caller_of(owner))["ok"] is False
    assert registry.revoke({"run_id": RUN, "token": "x" * 100_000}, caller_of(owner))["ok"] is False
    assert registry.revoke({"run_id": RUN, "token": first.token}, caller_of(owner))["ok"]
    second = revoke(owner, RUN, [owner_key(RSAPrivateKey())], previous=first, now=20.0)
    assert registry.revoke({"run_id": RUN, "token": second.token}, caller_of(owner))["ok"]
    # an older list (a replay of the first) does not take the newer one's place
    assert "newer" in registry.revoke({"run_id": RUN, "token": first.token}, caller_of(owner))["reason"]
    assert registry.list_revocations({"run_id": RUN, "owners": [owner_key(owner)]}) == {"revocations": [second.token]}
    # lists are asked for by owner key: a stranger's is not in the owner's reply; one IP posts a bounded number
    posted = [registry.revoke({"run_id": RUN, "token": revoke(k, RUN, [learner]).token}, caller_of(k, "10.9.9.9"))["ok"]
              for k in [RSAPrivateKey() for _ in range(MAX_REVOCATION_LISTS_PER_IP + 1)]]
    assert posted == [True] * MAX_REVOCATION_LISTS_PER_IP + [False]
    assert registry.list_revocations({"run_id": RUN, "owners": [owner_key(owner)]}) == {"revocations": [second.token]}
