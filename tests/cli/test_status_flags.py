"""`swarm status` flags (swarm.health.status_flags) on membership records made by hand: each flag is
raised when its record says so and not for a healthy swarm; then the fields they read travel through
both transports' real membership records, and a sampler counts the learner's refusals by kind."""

from types import SimpleNamespace

import pytest

from benchmarks.waiting import wait_until
from swarm.fabric.membership.records import REFUSALS, Heartbeat, MemberRecord, Refusals, refusal_category
from swarm.health import (LATE_HEARTBEATS, PICKUP_S, REFUSED_IN_A_ROW, STALL_FACTOR, STALL_MIN_S, status_flags,
                          swarm_args)

NOW = 1_000_000.0
ARGS = "--peers /ip4/1.2.3.4/tcp/31337/p2p/Qm --run-id r1"


def member(role: str, name: str, **fields) -> SimpleNamespace:
    values = dict(role=role, peer_id=name, model="embedded", model_hash="", version=10, rollouts=0, tokens_per_s=0.0,
                  software="0", time=NOW - 1.0, heartbeat_s=5.0)
    values.update(fields)
    return SimpleNamespace(record=MemberRecord(**values), owner=name.encode())


def healthy() -> list:
    """A learner at version 10 that stepped 2 s ago (every 3 s), two samplers at 9 and 10."""
    return [member("learner", "L", step_s=3.0, since_step_s=2.0, holds=[8, 9, 10]),
            member("sampler", "S1", version=9, holds=[9], refused=3, refused_in_a_row=1, refusal="busy"),
            member("sampler", "S2", version=10, fetch_version=10)]


def flags(members, announced=None) -> list[dict]:
    return status_flags(NOW, members, announced, args=ARGS)


def kinds(found) -> list[tuple[str, str]]:
    return [(f["kind"], f["peer"]) for f in found]


def test_a_healthy_swarm_raises_no_flag():
    assert flags(healthy()) == []
    assert flags(healthy(), announced=10) == []


def test_every_flag_has_a_message_and_a_command_pointed_at_the_swarm():
    members = [member("learner", "L", step_s=1.0, since_step_s=500.0, time=NOW - 60.0),
               member("sampler", "S1", version=2, refused_in_a_row=40, refused=41, refusal="stale")]
    found = flags(members)
    assert {f["kind"] for f in found} == {"late_heartbeat", "refused", "learner_stalled", "version_not_picked_up"}
    for flag in found:
        assert set(flag) == {"kind", "peer", "message", "command"} and flag["message"] and flag["command"]
        assert flag["command"].startswith(("swarm status " + ARGS, "swarm dashboard " + ARGS, "tail ", "grep "))


def test_no_learner_and_no_sampler():
    assert kinds(flags([])) == [("no_learner", ""), ("no_sampler", "")]
    assert kinds(flags([member("sampler", "S1")])) == [("no_learner", "")]
    only_learner = flags([member("learner", "L", step_s=0.0, since_step_s=1.0)])
    assert kinds(only_learner) == [("no_sampler", "")]
    assert only_learner[0]["command"] == f"swarm status {ARGS} --watch 5"


def test_a_late_heartbeat_is_flagged_by_the_peers_own_interval():
    beat = 5.0
    members = healthy()
    members[1] = member("sampler", "S1", version=9, time=NOW - LATE_HEARTBEATS * beat - 1)
    found = flags(members)
    assert kinds(found) == [("late_heartbeat", "S1")]
    assert "last heard 11 s ago" in found[0]["message"] and found[0]["command"].endswith("--watch 5")
    # just under the limit: not late
    members[1] = member("sampler", "S1", version=9, time=NOW - LATE_HEARTBEATS * beat + 1)
    assert flags(members) == []
    # a peer that heartbeats every 30 s is not late after 20 s; one that does not say is held to the default
    members[1] = member("sampler", "S1", version=9, time=NOW - 20, heartbeat_s=30.0)
    assert flags(members) == []
    members[1] = member("sampler", "S1", version=9, time=NOW - 20, heartbeat_s=0.0)
    assert kinds(flags(members)) == [("late_heartbeat", "S1")]


@pytest.mark.parametrize("refusal, words", [("stale", "--max-staleness"), ("malformed", "another model"),
                                            ("busy", "queue is full"), ("unreachable", "cannot reach the learner")])
def test_a_sampler_whose_groups_are_all_refused_is_flagged_with_why(refusal, words):
    members = healthy()
    members[1] = member("sampler", "S1", version=9, refused=100, refused_in_a_row=REFUSED_IN_A_ROW, refusal=refusal)
    found = flags(members)
    assert kinds(found) == [("refused", "S1")]
    assert f"last {REFUSED_IN_A_ROW} groups" in found[0]["message"] and f"as {refusal}" in found[0]["message"]
    assert words in found[0]["message"]
    assert found[0]["command"] == "grep '\"event\": \"sent\"' RUN_DIR/events.jsonl | tail -n 5"
    # refusals now and then (one accepted since): not flagged
    members[1] = member("sampler", "S1", version=9, refused=100, refused_in_a_row=REFUSED_IN_A_ROW - 1, refusal=refusal)
    assert flags(members) == []


def test_a_learner_that_stopped_stepping_is_flagged():
    members = healthy()
    idle = STALL_FACTOR * 10.0 + 5  # usual step 10 s, idle 55 s (its record is 1 s old)
    members[0] = member("learner", "L", step_s=10.0, since_step_s=idle - 1, holds=[10])
    found = flags(members)
    assert kinds(found) == [("learner_stalled", "L")]
    assert "has not stepped for 55 s, 6 times its usual 10.0 s" in found[0]["message"]
    assert found[0]["command"] == "tail -n 20 RUN_DIR/events.jsonl"
    # 4 usual steps without one: not yet
    members[0] = member("learner", "L", step_s=10.0, since_step_s=39.0, holds=[10])
    assert flags(members) == []
    # a fast learner idle for 5 of its steps but under STALL_MIN_S: a pause, not a stall
    members[0] = member("learner", "L", step_s=1.0, since_step_s=STALL_MIN_S - 5, holds=[10])
    assert flags(members) == []
    # no step yet, long after it started
    members[0] = member("learner", "L", step_s=0.0, since_step_s=STALL_MIN_S + 10, holds=[10])
    found = flags(members)
    assert kinds(found) == [("learner_stalled", "L")] and "no step" in found[0]["message"]
    # a learner from before these fields (heartbeat_s 0): nothing is claimed about it
    members[0] = member("learner", "L", heartbeat_s=0.0, step_s=0.0, since_step_s=0.0, holds=[10])
    assert flags(members) == []


def test_versions_no_sampler_picked_up_are_flagged():
    samplers = [member("sampler", "S1", version=3, holds=[3], fetch_version=3), member("sampler", "S2", version=2)]
    # the learner stepped every 2 s up to version 10, the last 5 s ago: version 4 came about 5 + 6 * 2 = 17 s ago
    learner = member("learner", "L", step_s=2.0, since_step_s=4.0)
    assert flags([learner, *samplers]) == []
    # ... and 80 s ago: versions 4..10 are overdue (the learner still steps: not stalled)
    learner = member("learner", "L", step_s=20.0, since_step_s=39.0)
    found = flags([learner, *samplers])
    assert kinds(found) == [("version_not_picked_up", "L")]
    assert "versions 4..10" in found[0]["message"] and "at most version 3" in found[0]["message"]
    assert found[0]["command"] == f"swarm dashboard {ARGS}"
    # one version, published long ago (the learner has stalled too)
    found = flags([member("learner", "L", version=4, step_s=1.0, since_step_s=PICKUP_S + 1), *samplers])
    assert kinds(found) == [("learner_stalled", "L"), ("version_not_picked_up", "L")]
    assert "version 4 of learner L is held by no sampler" in found[1]["message"]
    # a sampler that fetched it (and does not use it yet: a pickup delay) has picked it up
    fetched = member("sampler", "S3", version=1, fetch_version=10)
    assert flags([member("learner", "L", step_s=20.0, since_step_s=39.0), *samplers, fetched]) == []


def test_swarm_args_quote_and_name_a_non_default_transport():
    assert swarm_args(["/ip4/1.2.3.4/tcp/1/p2p/Qm"], "r1", "hivemind") == "--peers /ip4/1.2.3.4/tcp/1/p2p/Qm --run-id r1"
    assert swarm_args(["h:1", "h:2"], "my run", "grpc") == "--peers h:1 --peers h:2 --run-id 'my run' --transport grpc"


def test_refusals_are_counted_under_a_fixed_set_of_kinds():
    assert refusal_category("version 3 is 70 steps stale (max 64)") == "stale"
    assert refusal_category("version 9 is from the future (learner is at 3)") == "future"
    assert refusal_category("busy") == "busy"
    assert refusal_category("banned after repeated bad rollouts") == "banned"
    assert refusal_category("prompt token ids outside the vocabulary (0..99)") == "malformed"
    assert refusal_category("could not be decoded (KeyError)") == "malformed"
    assert refusal_category("learner unreachable") == "unreachable"
    assert refusal_category("<script>anything else</script>") == "other"
    # a record carries one of them or nothing: no free text of a learner's
    with pytest.raises(ValueError):
        MemberRecord(**{**member("sampler", "S").record.dict(), "refusal": "busy; rm -rf /"})
    others = ("duplicate", "the learner is leaving", "more than 4 open rollout streams from one peer")
    assert [refusal_category(r) for r in others] == ["duplicate", "leaving", "streams"]
    assert {refusal_category(r) for r in others} <= set(REFUSALS)


def test_a_sampler_tallies_refusals_in_all_in_a_row_and_the_last_kind():
    tally = Refusals()
    tally.count([{"ok": False, "reason": "busy"}, {"ok": True}, {"ok": False, "reason": "version 1 is 9 steps stale (max 4)"}])
    assert (tally.total, tally.in_a_row, tally.last) == (2, 1, "stale")
    tally.count([{"ok": False, "reason": "learner unreachable"}] * 3)
    assert (tally.total, tally.in_a_row, tally.last) == (5, 4, "unreachable")
    tally.count([{"ok": True}])
    assert (tally.total, tally.in_a_row, tally.last) == (5, 0, "unreachable")  # the last refusal's kind stays


def test_record_bounds_refuse_claims_out_of_range():
    base = member("learner", "L").record.dict()
    for bad in ({"step_s": -1.0}, {"since_step_s": float("nan")}, {"heartbeat_s": float("inf")}, {"refused_in_a_row": -1},
                {"step_s": 1}):  # strict: an int is no float
        with pytest.raises(ValueError):
            MemberRecord(**{**base, **bad})
    new_fields = ("heartbeat_s", "step_s", "since_step_s", "refused", "refused_in_a_row", "refusal")
    old = {k: v for k, v in base.items() if k not in new_fields}
    assert MemberRecord(**old).heartbeat_s == 0.0  # a record from before these fields still parses


def test_status_fields_travel_in_real_records_and_raise_flags(make_fabric):
    """Over a real DHT / gRPC registry: what the peers write is what status_flags reads."""
    learner, sampler, observer = make_fabric(), make_fabric(), make_fabric()
    assert learner.heartbeat(Heartbeat(role="learner", version=7, holds=(7,), heartbeat_s=5.0,
                                       step_s=0.5, since_step_s=100.0))
    assert sampler.heartbeat(Heartbeat(role="sampler", version=7, heartbeat_s=5.0, refused=30,
                                       refused_in_a_row=12, refusal="stale"))
    wait_until(lambda: len(observer.members()) == 2, 20, "two members listed", every=0.25)
    members = observer.members()
    found = status_flags(observer.now(), members, None, args=swarm_args(["ADDR"], "r", make_fabric.transport))
    assert kinds(found) == [("refused", sampler.peer_id), ("learner_stalled", learner.peer_id)], found
    record = next(m.record for m in members if m.record.role == "sampler")
    assert (record.refused, record.refused_in_a_row, record.refusal, record.heartbeat_s) == (30, 12, "stale", 5.0)
