"""Several learners on one run: the owner's certificates, bit-identical gradient averaging over real
hivemind averagers, who may average, publish and download state, and the exact fixed-point sum
that makes every learner take the same step."""

import contextlib
import logging
import threading
import time

import pytest
import torch

from swarm.fabric.membership.authority import CertificateError, authorises, issue, parse
from swarm.fabric.signing import owner_key
from swarm.fabric.hivemind.learner_group import MemberState, canonical, from_fixed_point, to_fixed_point


@pytest.fixture(scope="module")
def keys():
    from hivemind.utils.crypto import RSAPrivateKey

    return {name: RSAPrivateKey() for name in ("owner", "learner", "stranger")}


def test_a_certificate_admits_one_learner_to_one_run_of_one_owner(keys):
    owner, learner, stranger = (owner_key(keys[k]) for k in ("owner", "learner", "stranger"))
    token = issue(keys["owner"], "run-a", learner).token
    cert = parse(token)
    assert (cert.run_id, cert.learner, cert.owner) == ("run-a", learner, owner)
    assert authorises(token, "run-a", {owner}, learner)
    assert not authorises(token, "run-b", {owner}, learner)  # another run
    assert not authorises(token, "run-a", {owner}, stranger)  # presented by another key
    assert not authorises(token, "run-a", {stranger}, learner)  # a run whose owner is someone else
    # a certificate the stranger signs for itself names the stranger as owner: useless in run-a
    forged = issue(keys["stranger"], "run-a", stranger).token
    assert not authorises(forged, "run-a", {owner}, stranger)
    # swapping the body of a real certificate breaks its signature
    body, signature = token.split(".")
    other_body = issue(keys["owner"], "run-a", stranger).token.split(".")[0]
    with pytest.raises(CertificateError, match="signature"):
        parse(f"{other_body}.{signature}")
    for junk in ("", "abc", "a.b.c", "x" * 5000, f"{body}.{signature[:-8]}"):
        assert not authorises(junk, "run-a", {owner}, learner)


def test_announcements_of_certified_learners_count_and_others_do_not(keys):
    from swarm.fabric.weights.announcements import RunSampling, VersionAnnouncement
    from swarm.fabric.weights.announcements import newest_authorised

    owner, learner, stranger = (owner_key(keys[k]) for k in ("owner", "learner", "stranger"))
    cert = issue(keys["owner"], "run", learner).token

    def ann(version, digest, peer, certificate=""):
        return VersionAnnouncement.of("run", version, digest * 64, peer, 1.0, RunSampling(), certificate=certificate).dict()

    items = [(owner, ann(3, "a", "owner-peer")), (learner, ann(3, "a", "learner-peer", cert)),
             (stranger, ann(9, "b", "stranger-peer", cert))]  # the learner's certificate, replayed by another key
    found = newest_authorised(items, [owner], "run")
    assert (found.version, found.peer_id, found.peers) == (3, "owner-peer", ("learner-peer", "owner-peer"))
    # the certified learner ahead: its version is the newest, and only it is sent rollouts for it
    found = newest_authorised([*items, (learner, ann(4, "c", "learner-peer", cert))][1:], [owner], "run")
    assert (found.version, found.peers) == (4, ("learner-peer",))
    assert newest_authorised([(learner, ann(3, "a", "learner-peer"))], [owner], "run") is None  # no certificate


def test_fixed_point_sums_are_exact_and_the_same_at_every_member():
    torch.manual_seed(0)
    shapes = [torch.Size([64, 33]), torch.Size([7])]
    # gradients whose sum cancels: float32 averaging in any order would differ in the last bits
    grads = [[torch.randn(s) * scale for s in shapes] for scale in (1.0, 1e-4, 3.0)]
    grads.append([-(a + b + c) for a, b, c in zip(*grads)])
    rows = [5, 1, 2, 8]
    fixed = [to_fixed_point(g, shapes, r)[0] for g, r in zip(grads, rows)]
    exact_sum = sum(fixed)  # integers below 2^53: exact in float64
    assert torch.equal(exact_sum, exact_sum.round())
    members = len(fixed)
    # hivemind hands each member its own tensor plus (average - own), each rounded: on the raw
    # float32 gradients the members' results differ in the last bits...
    raw = [g[0] for g in grads[:3]]
    raw_average = sum(raw) / 3
    assert not all(torch.equal(raw[0] + (raw_average - raw[0]), r + (raw_average - r)) for r in raw[1:])
    # ...on fixed point they come back within ulps (here: one ulp up or down at some members)...
    average = exact_sum / members
    received = [f + (average - f) for f in fixed]
    received[1] = torch.nextafter(received[1], torch.full_like(received[1], float("inf")))
    received[2] = torch.nextafter(received[2], torch.full_like(received[2], float("-inf")))
    means = [from_fixed_point(r, members, sum(rows), shapes) for r in received]
    for mean in means[1:]:  # ...and the recovered means are the same bits
        assert all(torch.equal(a, b) for a, b in zip(means[0], mean))
    expected = [sum(g[i].double() * r for g, r in zip(grads, rows)) / sum(rows) for i in range(len(shapes))]
    for got, want in zip(means[0], expected):
        assert float((got.double() - want).abs().max()) < 1e-6
    # values past the range are clamped and counted, never wrapped
    huge, clamped = to_fixed_point([torch.full((3,), 1e9)], [torch.Size([3])], 1)
    assert clamped == 3 and float(huge.max()) == 2.0 ** 43


def test_the_canonical_state_is_the_newest_version_most_members_hold():
    def m(peer, version, digest):
        return MemberState(peer, version, digest, 1)

    assert canonical([m("a", 5, "x"), m("b", 5, "y"), m("c", 5, "y")]) == (5, "y")
    assert canonical([m("a", 5, "x"), m("b", 6, "z")]) == (6, "z")  # a learner ahead wins over one behind
    assert canonical([m("b", 5, "y"), m("a", 5, "x")]) == (5, "x")  # a tie goes to the lowest peer id


@contextlib.contextmanager
def learner_groups(averager_classes):
    """One real DHT process on loopback per entry, each with a learner's averaging group; an entry
    other than None is the averager class that member runs (a faulty one, in a test)."""
    from swarm.fabric.hivemind import learner_group
    from swarm.fabric.hivemind.dht import start_dht

    dhts, groups = [], []
    try:
        for cls in averager_classes:
            dht, _ = start_dht("learners", initial_peers=[str(a) for a in dhts[0].get_visible_maddrs()] if dhts else [],
                               host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            dhts.append(dht)
        params = [torch.nn.Parameter(torch.zeros(300, 17)), torch.nn.Parameter(torch.zeros(5))]
        for dht, cls in zip(dhts, averager_classes):
            with pytest.MonkeyPatch.context() as patch:
                if cls is not None:
                    patch.setattr(learner_group, "GuardedAverager", cls)
                groups.append(learner_group.LearnerGroup(dht, "learners", params, matchmaking_s=1.0,
                                                         request_timeout_s=0.8))
        yield groups, params
    finally:
        for g in groups:
            g.close()
        for d in dhts:
            d.shutdown()


@pytest.fixture
def averagers():
    """Three real DHT processes on loopback, each with a learner's averaging group."""
    with learner_groups([None] * 3) as made:
        yield made


def _rounds(groups, contributions, version=0, digest="h" * 64, timeout_s=15.0):
    out = [None] * len(groups)

    def run(i):
        grads, rows = contributions[i]
        out[i] = groups[i].average(grads, rows, version, digest, timeout_s)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(groups))]
    [t.start() for t in threads]
    [t.join(timeout=timeout_s + 60) for t in threads]
    return out


def test_authorised_learners_average_to_identical_bits_and_a_stranger_is_kept_out(averagers):
    groups, params = averagers
    a, b, stranger = groups
    for g in (a, b):
        g.allow([a.peer_id, b.peer_id])
    stranger.allow([a.peer_id, b.peer_id, stranger.peer_id])  # it lets everyone in; nobody lets it in
    torch.manual_seed(1)
    contributions = [([torch.randn_like(p) for p in params], 3), ([torch.randn_like(p) * 1e-3 for p in params], 5),
                     ([torch.full_like(p, 1e3) for p in params], 100)]
    ra, rb, rs = _rounds(groups, contributions)
    assert (ra.error, rb.error) == ("", "")
    assert sorted(m.peer_id for m in ra.members) == sorted([a.peer_id, b.peer_id])
    assert ra.total_rows == rb.total_rows == 8
    assert all(torch.equal(x, y) for x, y in zip(ra.grads, rb.grads))
    want = [(contributions[0][0][i].double() * 3 + contributions[1][0][i].double() * 5) / 8 for i in range(2)]
    assert all(float((g.double() - w).abs().max()) < 1e-6 for g, w in zip(ra.grads, want))  # no trace of the 1e3
    # The stranger got nothing of theirs: either it found nobody, or (under load) a learner joined its
    # group, saw the stranger and left before sending a byte, so its "average" is its own constant
    # contribution; any of a's or b's random gradient in it would make its values differ.
    assert rs.grads is None or all(torch.unique(g).numel() == 1 for g in rs.grads), rs
    # the stranger cannot take the learners' state either
    a.serve_state(lambda: ({"version": 1}, [torch.ones(2)]), 1)
    assert stranger.download_state([a.peer_id], timeout_s=5) is None
    got = b.download_state([a.peer_id], timeout_s=10)
    assert got is not None and got[1] == {"version": 1} and torch.equal(got[2][0], torch.ones(2))


def test_a_round_ends_early_when_the_others_have_left():
    """A learner looking for its group stops looking once every other learner says it is leaving
    (peers/learner.py writes that record as it stops), instead of waiting out the round's timeout."""
    with learner_groups([None] * 2) as (groups, params):
        a, b = groups
        a.allow([a.peer_id, b.peer_id])  # b is allowed but never averages: it has left
        asked = []
        started = time.time()
        result = a.average([torch.ones_like(p) for p in params], 2, 0, "h" * 64, 30.0,
                           others_present=lambda: asked.append(time.time()) or False)
        took = time.time() - started
    assert result.grads is None and len(result.members) == 1 and "every other learner left" in result.error, result
    assert len(asked) >= 2 and took < 15.0, (len(asked), took)  # not the 30 s timeout


def test_a_member_out_of_step_is_told_so_and_the_others_go_on(averagers):
    groups, params = averagers
    a, b, _ = groups
    for g in (a, b):
        g.allow([a.peer_id, b.peer_id])
    grads = [torch.ones_like(p) for p in params]
    out = [None, None]

    def run(i, version, digest):
        out[i] = groups[i].average(grads, 2, version, digest, 15.0)

    threads = [threading.Thread(target=run, args=(0, 7, "a" * 64)), threading.Thread(target=run, args=(1, 6, "b" * 64))]
    [t.start() for t in threads]
    [t.join(timeout=80) for t in threads]
    assert out[0].in_step and out[0].canonical == (7, "a" * 64) and out[0].grads is not None
    assert not out[1].in_step and out[1].grads is None  # behind: it downloads the state instead


def test_a_round_whose_all_reduce_comes_back_incomplete_is_failed_not_stepped_on():
    """A real member whose reducer hangs up without averaging its part (the honest member leaves it
    the whole vector to reduce): hivemind would hand the honest member its own values back and
    report success, so the two would hold different means. Here every attempt fails at the honest
    member, and the round ends marked partial, with no gradient to step on."""
    from typing import AsyncIterator

    from hivemind.p2p import P2PContext
    from hivemind.proto import averaging_pb2

    from swarm.fabric.hivemind import learner_group
    from swarm.fabric.hivemind.learner_group import PARTIAL_ROUND

    guarded = learner_group.GuardedAverager

    class ReducerThatHangsUp(guarded):
        async def rpc_aggregate_part(self, stream, context):
            await anext(stream)  # takes the sender's first part, averages nothing, answers nothing
            return
            yield

    class LeavesTheReducingToOthers(guarded):  # bandwidth 0: the other member reduces the whole vector
        def __init__(self, *args, **kwargs):
            super().__init__(*args, bandwidth=0.0, **kwargs)

    # hivemind names each handler after the servicer's class: the same name, or nobody finds it
    for cls in (ReducerThatHangsUp, LeavesTheReducingToOthers):
        cls.__name__ = cls.__qualname__ = guarded.__name__
    ReducerThatHangsUp.rpc_aggregate_part.__annotations__ = {
        "stream": AsyncIterator[averaging_pb2.AveragingData], "context": P2PContext,
        "return": AsyncIterator[averaging_pb2.AveragingData]}

    with learner_groups([LeavesTheReducingToOthers, ReducerThatHangsUp]) as (groups, params):
        honest, faulty = groups
        for g in groups:
            g.allow([honest.peer_id, faulty.peer_id])
        torch.manual_seed(2)
        contributions = [([torch.randn_like(p) for p in params], 3), ([torch.randn_like(p) for p in params], 5)]
        ours, theirs = _rounds(groups, contributions, timeout_s=6.0)
    assert ours.grads is None and ours.partial and PARTIAL_ROUND in ours.error, ours
    assert len(ours.members) == 1  # no gathered round to step on
    # the faulty member never got the honest one's part for its own slice: partial there too
    assert theirs.grads is None and theirs.partial, theirs


def test_a_round_that_hivemind_cancels_is_a_failed_round_not_an_exception():
    """hivemind can end a step with asyncio's CancelledError (its matchmaking gives up on a group it
    was assembling; seen in CI), a BaseException that `except Exception` lets through: the learner's
    round thread would die of it. Here every attempt's matchmaking ends so: the round comes back
    failed (swarm/team.py steps on its own gradient then, as after any failed round)."""
    import asyncio

    from swarm.fabric.hivemind import learner_group

    guarded = learner_group.GuardedAverager

    class MatchmakingGivesUp(guarded):
        async def _step(self, **kwargs):
            async def gives_up(step):
                raise asyncio.CancelledError()

            self._matchmaking.look_for_group = gives_up  # (in the averager's own process)
            return await super()._step(**kwargs)

    MatchmakingGivesUp.__name__ = MatchmakingGivesUp.__qualname__ = guarded.__name__  # hivemind's handler names
    with learner_groups([MatchmakingGivesUp]) as (groups, params):
        result = _rounds(groups, [([torch.ones_like(p) for p in params], 2)], timeout_s=3.0)[0]
    assert result is not None  # None: the round's thread died of the exception
    assert result.grads is None and "CancelledError" in result.error and len(result.members) == 1, result


def test_learners_train_one_run_together_survive_a_kill_take_a_late_joiner_and_ignore_a_stranger(tmp_path):
    """Real processes on loopback: an owner learner and a certified one train with two samplers,
    publishing the same weights at every version; a learner whose certificate is its own is ignored;
    the certified one is SIGKILLed and the owner goes on; a third joins late and matches."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from swarm.runlog import read_jsonl, wait_ready
    from tests.helpers.certificates import certificate as certificate_for

    swarm = [sys.executable, "-m", "swarm.cli"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = (tmp_path / "peers.log").open("w")
    procs = {}

    def spawn(name, *args):
        procs[name] = subprocess.Popen([*swarm, *args], stdout=log, stderr=subprocess.STDOUT, env=env, text=True)
        return procs[name]

    def tail():
        return (tmp_path / "peers.log").read_text()[-4000:]

    def ready(name):
        found = wait_ready(tmp_path / name, timeout_s=180, alive=lambda: procs[name].poll() is None)
        assert found is not None, tail()
        return found

    def steps(name):
        return {int(r["step"]): r for r in read_jsonl(tmp_path / name / "steps.jsonl")} if (tmp_path / name / "steps.jsonl").exists() else {}

    def wait_for(condition, timeout_s, what):
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if condition():
                return
            time.sleep(0.2)
        raise AssertionError(f"{what} within {timeout_s}s\n{tail()}")

    def left_of(name):
        """Processes of peer `name`: forks of it (its run dir on their command line) and its p2pd (its key file)."""
        import psutil

        run_dir, identity = str(tmp_path / name), str(tmp_path / f"{name}-id")
        return [p.pid for p in psutil.process_iter(["cmdline"])
                if any(arg == run_dir or identity in arg for arg in p.info["cmdline"] or [])]

    def certificate(identity, signer_key_file):  # in this process: six CLI starts fewer on this test's path
        return certificate_for(tmp_path / identity, signer_key_file)

    def published(name):  # version -> hash, as published (in the background: a version may be skipped)
        path = tmp_path / name / "events.jsonl"
        return {e["version"]: e["hash"] for e in read_jsonl(path) if e["event"] == "published"} if path.exists() else {}

    def averaged(name):  # versions this learner made in a step on the group's mean gradient
        return {v for v, r in steps(name).items() if r.get("learners", 1.0) >= 2.0}

    def same_weights(a, b, at_least):
        """The versions both published from an averaged step, whose weights differ (None: fewer than
        `at_least` such versions yet). Each steps alone when a round times out with both present, and
        so may publish a version number under other weights than the other's; the next round finds
        them apart and one takes the other's state (the round's canonical hash), never publishing that
        number again."""
        sa, sb = published(a), published(b)
        common = sorted(set(sa) & set(sb) & averaged(a) & averaged(b))
        if len(common) < at_least:
            return None
        return [v for v in common if sa[v] != sb[v]]

    learner_args = ["--steps", "1000", "--groups-per-step", "4", "--checkpoint-every", "0", "--max-completion-length", "12",
                    "--averaging-timeout-s", "20"]
    try:
        spawn("boot", "bootstrap", "--host", "127.0.0.1", "--port", "0", "--identity", str(tmp_path / "boot.key"),
              "--run-dir", str(tmp_path / "boot"))
        addr = ready("boot")["addresses"][0]
        spawn("owner", "learner", "--peers", addr, "--run-dir", str(tmp_path / "owner"), "--identity-dir",
              str(tmp_path / "owner-id"), *learner_args)
        owner = ready("owner")
        assert owner["learner_key"] == owner["own_key"] and owner["owner_key_file"]
        for s in ("s1", "s2"):
            spawn(s, "sampler", "--peers", addr, "--learner-key-file", str(tmp_path / "owner" / "learner.key"),
                  "--prompts-per-round", "2", "--num-generations", "4", "--identity-dir", str(tmp_path / f"{s}-id"),
                  "--run-dir", str(tmp_path / s))
        # the owner certifies a second learner's key; the certificate is all that learner needs
        cert = tmp_path / "second.cert"  # as a file (`authorize --out`); the others as the token itself
        cert.write_text(certificate("second-id", owner["owner_key_file"]))
        # and a third's, which joins late (made now: the late joiner then starts the moment the second dies)
        cert3 = certificate("third-id", owner["owner_key_file"])
        spawn("second", "learner", "--peers", addr, "--run-dir", str(tmp_path / "second"), "--identity-dir",
              str(tmp_path / "second-id"), "--certificate", str(cert), *learner_args)
        second = ready("second")
        assert second["learner_key"] == owner["learner_key"] != second["own_key"]  # samplers pin the run, not it
        # a stranger signs its own certificate: a run of its own that nobody follows
        forged = certificate("stranger-id", tmp_path / "stranger-id" / "learner.sign.key")
        spawn("stranger", "learner", "--peers", addr, "--run-dir", str(tmp_path / "stranger"), "--identity-dir",
              str(tmp_path / "stranger-id"), "--certificate", forged, *learner_args)

        # together: the same weights at every version both published, gradients from both
        wait_for(lambda: (same_weights("owner", "second", 2) is not None
                          and sum(r.get("learners") == 2.0 for r in steps("second").values()) >= 2), 400,
                 "two learners stepping together")
        assert same_weights("owner", "second", 2) == []
        assert any(r.get("learners") == 2.0 and r["groups"] > 0 for r in steps("owner").values())

        def sent_to():
            return {e["learner"] for s in ("s1", "s2") for e in read_jsonl(tmp_path / s / "events.jsonl") if e["event"] == "sent"}

        # samplers spread their rounds over both (the second only once they have read its announcement:
        # on a loaded machine that can come after the first rounds together)
        wait_for(lambda: {second["peer_id"], owner["peer_id"]} <= sent_to(), 240, "samplers sending to both learners")
        stranger = ready("stranger")  # (started up meanwhile)
        assert stranger["peer_id"] not in sent_to()
        assert all(r.get("learners", 1.0) <= 2.0 for name in ("owner", "second") for r in steps(name).values())

        # the second learner dies mid-run: the owner steps on alone, never backwards
        procs["second"].send_signal(signal.SIGKILL)
        procs["second"].wait(timeout=30)
        # nothing of it lingers: its DHT process, p2pd and averager process follow it
        wait_for(lambda: not left_of("second"), 20, "the killed learner's processes gone")
        killed_at = max(steps("owner"))
        # a third learner joins late (starting while the owner waits out its round with the dead one)
        spawn("third", "learner", "--peers", addr, "--run-dir", str(tmp_path / "third"), "--identity-dir",
              str(tmp_path / "third-id"), "--certificate", cert3, *learner_args)
        wait_for(lambda: max(steps("owner")) >= killed_at + 2, 300, "the owner stepping on after the kill")
        owner_steps = steps("owner")
        versions = [int(r["step"]) for r in read_jsonl(tmp_path / "owner" / "steps.jsonl")]
        assert versions == sorted(set(versions))  # never twice, never backwards
        # and no version skipped: one the owner did not step itself it took from the other learner,
        # as a learner does whose round came back incomplete while the other stepped on the full mean
        # (a download can move it on by several versions, the other having stepped alone meanwhile)
        downloads = [e for e in read_jsonl(tmp_path / "owner" / "events.jsonl") if e["event"] == "state_downloaded"]
        taken = {v for e in downloads for v in range(e["previous"] + 1, e["version"] + 1)}
        assert set(range(versions[0], versions[-1] + 1)) <= set(versions) | taken, (versions, sorted(taken))
        # alone, or (the kill cutting its round short) on the state it took once its round came back incomplete
        assert (any(owner_steps[v].get("learners", 1.0) == 1.0 for v in versions if v > killed_at)
                or any(e["version"] >= killed_at for e in downloads)), (versions, downloads, killed_at)

        # the third downloads the owner's state (nobody else holds it now) and matches the owner
        ready("third")
        joined = read_jsonl(tmp_path / "third" / "events.jsonl")
        assert any(e["event"] == "state_downloaded" and e["version"] >= killed_at for e in joined), joined[:5]
        wait_for(lambda: same_weights("owner", "third", 2) is not None, 300, "the late learner stepping with the owner")
        assert same_weights("owner", "third", 2) == []
        assert not (tmp_path / "stranger" / "steps.jsonl").exists() or all(
            r.get("learners", 1.0) == 1.0 for r in steps("stranger").values())  # nobody averaged with it
        # stopped together: one still looking for its group reads the other's leaving record and
        # steps alone, rather than waiting out its round's 20 s for a learner that has gone
        stopping = time.time()
        for name in ("owner", "third"):
            procs[name].send_signal(signal.SIGTERM)
        for name in ("owner", "third"):
            assert procs[name].wait(timeout=120) == 0, tail()
        alone = [e for name in ("owner", "third") for e in read_jsonl(tmp_path / name / "events.jsonl")
                 if e["event"] == "averaging_alone" and e["time"] > stopping]
        assert all("every other learner left" in e["reason"] for e in alone), alone
        assert json.loads((tmp_path / "owner" / "published.json").read_text())["version"] == max(steps("owner"))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        log.close()


def test_a_learner_steps_on_the_mean_alone_or_not_at_all_as_its_round_went():
    """LearnerTeam's choice after a round (team.round_outcome): the group's mean when it met in step;
    its own gradient when nobody else came; no step but a download of the group's state when it is
    behind, holds other weights, or its all-reduce came back incomplete (the others may have
    stepped on the full mean: stepping alone would publish other weights as the same version)."""
    from swarm.fabric.hivemind.learner_group import RoundResult
    from swarm.team import round_outcome

    me, other = MemberState("me", 5, "a" * 64, 4), MemberState("other", 5, "a" * 64, 4)
    mean = [torch.ones(3)]

    def round_(members, *, grads=None, in_step=True, partial=False, error="", clamped=0):
        return RoundResult(members=members, grads=grads, total_rows=sum(m.rows for m in members),
                           canonical=canonical(members), in_step=in_step, seconds=0.5, clamped=clamped,
                           error=error, partial=partial)

    stepped = round_outcome(round_([me, other], grads=mean, clamped=2), 5, me.weights_hash)
    assert stepped.grads is mean and not stepped.resync
    assert stepped.metrics == {"learners": 2.0, "averaging_seconds": 0.5, "group_rows": 8.0, "clamped_gradients": 2.0}

    alone = round_outcome(round_([me], error="no group formed"), 5, me.weights_hash)
    assert alone.grads is None and not alone.resync and alone.metrics["learners"] == 1.0
    # nobody came, but another learner present leads: it steps alone, and this one takes its next version
    # rather than publish version 6 under other weights (worth downloading: 6 or newer, not its own 5 again)
    led = round_outcome(round_([me], error="no group formed"), 5, me.weights_hash, leader="other")
    assert led.grads is None and led.resync and led.at_least == 6 and "learner other steps alone" in led.reason
    assert led.metrics["learners"] == 1.0

    incomplete = round_outcome(round_([me], partial=True, error="received 91.8% results"), 5, me.weights_hash)
    assert incomplete.grads is None and incomplete.resync and "incomplete (received 91.8% results)" in incomplete.reason

    ahead = MemberState("other", 6, "b" * 64, 4)
    behind = round_outcome(round_([me, ahead], grads=mean, in_step=False), 5, me.weights_hash)
    assert behind.grads is None and behind.resync and "group is at version 6, this learner at 5" in behind.reason

    mine = MemberState("me", 5, "c" * 64, 4)
    differs = round_outcome(round_([mine, other, MemberState("third", 5, "a" * 64, 4)], grads=mean, in_step=False), 5,
                            mine.weights_hash)
    assert differs.resync and f"hash {'a' * 12}, ours {'c' * 12}" in differs.reason

    no_rows = round_outcome(round_([me, other], grads=None, error=""), 5, me.weights_hash)
    assert no_rows.grads is None and not no_rows.resync and no_rows.metrics["averaging_error"] == "no rows in the group"


def test_one_learner_present_steps_alone_the_owners_else_the_lowest_peer_id():
    """team.leader_of: the run owner's own learner leads wherever it is present; among certified
    learners alone, the lowest peer id; the same answer from every learner's side."""
    from swarm.team import leader_of

    assert leader_of("Qm-c", True, {"Qm-a": False, "Qm-b": False}) == "Qm-c"  # the owner's, whatever its id
    assert leader_of("Qm-a", False, {"Qm-c": True, "Qm-b": False}) == "Qm-c"
    assert leader_of("Qm-b", False, {"Qm-c": True, "Qm-a": False}) == "Qm-c"
    views = {"Qm-b": ("Qm-c", "Qm-a"), "Qm-c": ("Qm-a", "Qm-b"), "Qm-a": ("Qm-b", "Qm-c")}  # no owner among them
    assert {leader_of(me, False, dict.fromkeys(others, False)) for me, others in views.items()} == {"Qm-a"}


@contextlib.contextmanager
def debug_level(log: logging.Logger):
    before = log.level
    log.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        log.setLevel(before)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@contextlib.contextmanager
def records_of(log: logging.Logger):
    """The records `log` lets through to its handlers (its filters applied) while in the block."""
    seen = _Records()
    log.addHandler(seen)
    try:
        yield seen.records
    finally:
        log.removeHandler(seen)


def log_raised(log: logging.Logger, failure: BaseException) -> None:
    """`failure` logged as hivemind logs what it catches (logger.exception, with its traceback)."""
    try:
        raise failure
    except BaseException as exc:  # noqa: BLE001
        log.exception(exc)


def test_handled_round_failures_and_a_dead_averager_log_no_error():
    """A round nobody joins is the learner's `averaging_alone` event, not hivemind's ERROR with a
    traceback ("could not find a group"); closing a group whose averager died first is not an ERROR
    either ("Averager shutdown has no effect"). Both printed at every multi-learner run's end."""
    import asyncio

    from hivemind.averaging.allreduce import AllreduceException
    from hivemind.averaging.matchmaking import MatchmakingException

    log = logging.getLogger("hivemind.averaging.averager")  # its averager process logs through this logger too
    with records_of(log) as seen:
        for failure in (AllreduceException("Averaging step failed: could not find a group"), asyncio.CancelledError(),
                        AllreduceException("group holds unauthorised peer(s): Qm..."), MatchmakingException("x"),
                        RuntimeError("a real fault")):
            log_raised(log, failure)  # as hivemind's DecentralizedAverager._step logs a round it gives up on
        # a round nobody joined is the learner's to report; any other failed round is still shown
        assert [r.getMessage() for r in seen] == ["group holds unauthorised peer(s): Qm...", "x", "a real fault"]
        assert {r.levelname for r in seen} == {"ERROR"}
        seen.clear()
        with debug_level(log):  # demoted, not dropped: a peer logging at DEBUG still shows it
            log_raised(log, AllreduceException("Averaging step failed: could not find a group"))
        assert [(r.levelname, r.getMessage()) for r in seen] == [("DEBUG", "Averaging step failed: could not find a group")]
        seen.clear()
        with learner_groups([None]) as (groups, params):
            (alone,) = groups
            alone.averager.terminate()
            alone.averager.join(timeout=10)
        assert not [r for r in seen if r.levelno >= logging.ERROR], [r.getMessage() for r in seen]


def test_a_dht_request_from_a_dead_process_logs_no_error():
    """An averager that dies with a request in flight: hivemind's DHT loop cannot rebuild its reply
    pipe and logged ConnectionResetError at ERROR with a traceback (from the loop's `_run`); other
    failures there are still shown."""
    import swarm.fabric.hivemind.dht  # noqa: F401  installs the filter

    log = logging.getLogger("hivemind.dht.dht")

    def _run(failure):  # named as hivemind.dht.dht.DHT._run, whose records are filtered (by the logging call's function)
        try:
            raise failure
        except Exception as exc:  # noqa: BLE001
            log.exception(exc)

    with records_of(log) as seen:
        for failure in (ConnectionResetError(104, "Connection reset by peer"), ConnectionRefusedError(111, "refused"),
                        RuntimeError("a real fault"), OSError("a broken pipe of this process's own")):
            _run(failure)
        log.error("a message with no exception")
        assert [r.getMessage() for r in seen] == ["a real fault", "a broken pipe of this process's own",
                                                  "a message with no exception"]
        seen.clear()
        with debug_level(log):
            _run(ConnectionResetError(104, "Connection reset by peer"))
        assert [r.levelname for r in seen] == ["DEBUG"]
