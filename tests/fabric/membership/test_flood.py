"""Hostile peers flooding the membership records of a real swarm (bootstrap, learner and sampler
processes, `swarm status` as a user runs it), with correctly signed, well-shaped records sent by a
real attacker node built from the project's own fabric code (tests/helpers/member_flood.py):

- 4,800 records signed by one key, under as many texts of it: one owner, at most one record;
- a learner record and announcement squatting at version 999999 under throwaway keys: the run's
  learner version is read from its own key's announcements only;
- a flood from throwaway keys: each well-formed one-per-key record is taken, but listings stay
  bounded per page, learners are found from the run's key (not the open pages), and training
  (whose samplers find relays and the learner's sharers through the listing) goes on.
"""

import json
import subprocess
import sys

import pytest

from benchmarks.waiting import wait_until
from swarm.cli.launcher import LocalSwarm
from swarm.config.learner_keys import decode_learner_key
from swarm.fabric.hivemind.records import MAX_LISTED_PER_PAGE
from swarm.fabric.membership.records import MEMBER_PAGES
from tests.helpers.member_flood import SQUATTED_VERSION, flood
from tests.helpers.processes import kill_started

pytestmark = pytest.mark.slow
SAMPLER = ("--prompts-per-round", "2", "--num-generations", "4", "--progress-every-s", "1")
THROWAWAY_KEYS = 200  # 2048-bit keys, ~50 ms each to make; benchmarks/member_flood.py floods with 10,000
# more than a page's listing holds over every page (16 x 256): a flood that got through would crowd each page;
# benchmarks/member_flood.py sends 10,000
ONE_KEY_RECORDS = 4_800


def steps_of(run_dir) -> list[dict]:
    path = run_dir / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def swarm(tmp_path):
    local = LocalSwarm(tmp_path, run_id="flood")
    try:
        yield local
    finally:
        kill_started(local)  # only the processes this test started, by pid


def status(addr: str, *extra: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "swarm.cli", "status", "--peers", addr, "--run-id", "flood", "--json", *extra],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_a_flood_of_members_is_refused_or_bounded_and_the_swarm_trains_on(swarm, tmp_path):
    from swarm.fabric.hivemind.dht import start_dht
    from swarm.fabric.hivemind.fabric import HivemindFabric

    run_dir = tmp_path / "learner"
    addr = swarm.start_bootstrap()
    boot_peer = addr.rsplit("/p2p/", 1)[1]
    learner, key = swarm.start_learner(addr, "--steps", "1000", "--groups-per-step", "1", "--checkpoint-every", "0",
                                       run_dir=run_dir)
    owner = decode_learner_key(key)
    attacker = HivemindFabric(*start_dht("flood", initial_peers=[addr]), "flood", heartbeat_s=5.0)
    try:
        # 4,800 records of one key, under 4,800 texts of it: every one refused (its one record
        # belongs in one page, under the key's one text). Throwaway keys: each one's own record is
        # well-formed and taken; its writes into the run owner's learner and version directories
        # (a squatting learner at version 999999) are not
        taken = flood(attacker.dht, boot_peer, "flood", one_key=ONE_KEY_RECORDS, throwaway=THROWAWAY_KEYS, owner=owner)
        assert taken == {"one_key": 0, "pages": THROWAWAY_KEYS, "learners": 0, "versions": 0}

        # what a user sees: the learner (found from the run's key), its own version, a bounded listing
        report = status(addr, "--learner-key", key)
        learner_id = learner.ready["peer_id"]
        assert learner_id in [p["peer_id"] for p in report["peers"] if p["role"] == "learner"]
        assert report["learner_version"] is not None and report["learner_version"] < SQUATTED_VERSION
        assert len(report["peers"]) <= MEMBER_PAGES * MAX_LISTED_PER_PAGE + 1
        assert sum(p["peer_id"].startswith("squat-") for p in report["peers"]) == 0  # the one-key flood: nothing listed
        # without the run's key, no version is made up from whoever calls itself a learner
        assert status(addr)["learner_version"] is None

        # training goes on: a sampler joining during the flood finds the learner's versions (its
        # relay list and the learner's sharer view come from the flooded listing)
        swarm.start_sampler("sampler-0", addr, key, *SAMPLER)
        wait_until(lambda: len(steps_of(run_dir)) >= 2, 240, "two learner steps during the flood", every=0.5,
                   logs=lambda: "\n".join(f"--- {p.name}:\n{p.text()[-1500:]}" for p in swarm.procs))
        # the flood was on all along: its records are still listed (bounded), as learners at 999999
        squatting = [m for m in attacker.members() if m.record.version == SQUATTED_VERSION]
        assert len(squatting) == THROWAWAY_KEYS
        learners = attacker.authorised_learners([owner])
        assert [m.record.peer_id for m in learners] == [learner_id]
        # (versions are published and announced off the training loop: a step's version follows it)
        wait_until(lambda: getattr(attacker.latest_announced([owner]), "version", 0) >= 1, 60,
                   "the learner's version 1 announced under the owner's key", every=0.5)
        announced = attacker.latest_announced([owner])
        assert announced is not None and 1 <= announced.version < SQUATTED_VERSION
    finally:
        attacker.shutdown()
    assert swarm.stop(learner) == 0, learner.text()[-3000:]


def test_two_texts_of_one_key_are_one_owner():
    from hivemind.utils.crypto import RSAPrivateKey

    from swarm.fabric.signing import canonical_owner, owner_key

    key = owner_key(RSAPrivateKey())
    variants = [key, key[:-1] + b" a comment]", key[:-1] + b" another@host]"]
    assert {canonical_owner(v) for v in variants} == {key}
    with pytest.raises(ValueError):
        canonical_owner(b"[owner:ssh-rsa not-a-key]")


def test_over_grpc_a_squatting_learner_does_not_set_the_version_status_shows(swarm, tmp_path):
    from swarm.fabric.grpc.fabric import GrpcFabric
    from swarm.fabric.membership.records import Heartbeat
    from tests.helpers.member_flood import throwaway_key

    swarm.transport = "grpc"
    addr = swarm.start_bootstrap()
    learner, key = swarm.start_learner(addr, "--steps", "1000", "--checkpoint-every", "0", run_dir=tmp_path / "learner")
    # one heartbeat only, so its record must outlive the `swarm status` calls below: at 5 s it
    # expired after 15 s, which a status call on a loaded machine outlasted (the squatter went unlisted)
    squatter = GrpcFabric(addr, "flood", throwaway_key(), heartbeat_s=60.0)
    try:
        # a peer of its own key calls itself a learner at version 999999 and announces it
        assert squatter.heartbeat(Heartbeat(role="learner", version=SQUATTED_VERSION))
        assert squatter.announce(SQUATTED_VERSION, "0" * 64)
        report = status(addr, "--transport", "grpc", "--learner-key", key)
        assert squatter.peer_id in [p["peer_id"] for p in report["peers"]]  # listed, as what it says it is...
        assert report["learner_version"] == 0  # ...but the version is the run key's announcement
        assert status(addr, "--transport", "grpc")["learner_version"] is None
    finally:
        squatter.shutdown()
    assert swarm.stop(learner) == 0, learner.text()[-3000:]
