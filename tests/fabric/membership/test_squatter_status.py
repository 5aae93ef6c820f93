"""Every status reader trusts only the run key's announcements: a squatter whose record calls it a
learner at version 999999 (and announces it under its own key) sets neither the version a
learner's dashboard shows (nor its rows' staleness) nor the bootstrap node's status line, on a
real bootstrap process; the bootstrap, which knows no run key, shows no learner version at all
and says where the verified one is read."""

import json
import urllib.request

import pytest

from benchmarks.waiting import wait_until
from swarm.cli.launcher import LocalSwarm
from swarm.dashboard import LiveDashboard, read_swarm
from swarm.fabric.membership.records import Heartbeat
from swarm.fabric.transports import observe
from tests.helpers.member_flood import SQUATTED_VERSION, throwaway_key
from tests.helpers.processes import kill_started

pytestmark = pytest.mark.slow
RUN = "squat"


@pytest.fixture
def swarm(tmp_path):
    local = LocalSwarm(tmp_path, run_id=RUN)
    try:
        yield local
    finally:
        kill_started(local)  # only the processes this test started, by pid


# the test heartbeats once, so records must outlive every wait below (at 5 s they expired after 15 s)
HEARTBEAT_S = 60.0


def peer(transport: str, addr: str, key):
    """A peer of its own key joined through `addr` (the squatter is one: its records are well-formed and signed)."""
    if transport == "grpc":
        from swarm.fabric.grpc.fabric import GrpcFabric

        return GrpcFabric(addr, RUN, key, heartbeat_s=HEARTBEAT_S)
    from swarm.fabric.hivemind.dht import start_dht
    from swarm.fabric.hivemind.fabric import HivemindFabric

    return HivemindFabric(*start_dht(RUN, initial_peers=[addr], signing_key=key), RUN, heartbeat_s=HEARTBEAT_S)


@pytest.mark.parametrize("transport", ["hivemind", "grpc"])
def test_a_squatting_learner_sets_no_version_a_dashboard_or_the_bootstrap_shows(swarm, tmp_path, transport):
    swarm.transport = transport
    boot = swarm.spawn("bootstrap", "bootstrap", "--host", "127.0.0.1", "--port", "0", "--run-id", RUN, "--status-every-s", "1",
                       "--identity", str(tmp_path / "keys" / "bootstrap.p2p.key"), "--transport", transport,
                       run_dir=tmp_path / "bootstrap")
    addr = swarm.wait_ready(boot)["addresses"][0]
    learner, squatter = peer(transport, addr, throwaway_key()), peer(transport, addr, throwaway_key())
    observer = observe(transport, run_id=RUN, peers=[addr])
    dashboard = None
    try:
        assert learner.heartbeat(Heartbeat(role="learner", version=3)) and learner.announce(3, "ab" * 32)
        assert squatter.heartbeat(Heartbeat(role="learner", version=SQUATTED_VERSION))
        assert squatter.announce(SQUATTED_VERSION, "cd" * 32)
        wait_until(lambda: len([m for m in observer.members() if m.record.role == "learner"]) == 2, 30, "both learner records")

        # a learner's dashboard: it knows its own key; the squatter is listed, as what it says it is,
        # but the version and every row's staleness are counted from the learner's announcement
        reading = read_swarm(observer, [learner.public_key])
        assert reading.announcement["version"] == 3
        rows = {r["peer_id"]: r for r in reading.peers}
        assert rows[learner.peer_id]["staleness"] == 0 and rows[squatter.peer_id]["staleness"] == 3 - SQUATTED_VERSION
        dashboard = LiveDashboard(observer, run_id=RUN, transport=transport, peers=[addr], host="127.0.0.1", port=0,
                                  learner_keys=[learner.public_key], poll_s=0.5)
        wait_until(lambda: json.loads(urllib.request.urlopen(f"{dashboard.url}/api/state", timeout=10).read())["polls"] > 0,
                   30, "a dashboard reading")
        state = json.loads(urllib.request.urlopen(f"{dashboard.url}/api/state", timeout=10).read())
        assert state["announcement"]["version"] == 3 and state["newest_version"] == 3
        # no key (`swarm dashboard` without --learner-key): no version at all, and the page says why
        unkeyed = read_swarm(observer, [])
        assert unkeyed.announcement is None and all(r["staleness"] is None for r in unkeyed.peers)

        # the bootstrap's status line and events: no learner version from the records
        events = tmp_path / "bootstrap" / "events.jsonl"
        statuses = lambda: [json.loads(line) for line in events.read_text().splitlines() if '"status"' in line]  # noqa: E731
        wait_until(lambda: any(e["learners"] == 2 for e in statuses()), 60, "a status line counting both learner records")
        assert statuses() and all("learner_version" not in e for e in statuses())
        log = boot.text()
        assert str(SQUATTED_VERSION) not in log and "swarm status --learner-key" in log, log[-2000:]
    finally:
        if dashboard is not None:
            dashboard.close()
        for fabric in (observer, squatter, learner):
            fabric.shutdown()

