"""Several learners on one run: the owner's certificates, bit-identical gradient averaging over real
hivemind averagers, who may average, publish and download state, and the exact fixed-point sum
that makes every learner take the same step."""

import threading

import pytest
import torch

from swarm.fabric.authority import CertificateError, authorises, issue, parse, subkey_of
from swarm.fabric.learner_group import MemberState, canonical, from_fixed_point, to_fixed_point


@pytest.fixture(scope="module")
def keys():
    from hivemind.utils.crypto import RSAPrivateKey

    return {name: RSAPrivateKey() for name in ("owner", "learner", "stranger")}


def test_a_certificate_admits_one_learner_to_one_run_of_one_owner(keys):
    owner, learner, stranger = (subkey_of(keys[k]) for k in ("owner", "learner", "stranger"))
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
    from swarm.fabric.records import RunSampling, VersionAnnouncement
    from swarm.fabric.versions import newest_authorised

    owner, learner, stranger = (subkey_of(keys[k]) for k in ("owner", "learner", "stranger"))
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


@pytest.fixture
def averagers():
    """Three real DHT processes on loopback, each with a learner's averaging group."""
    from swarm.fabric.dht import start_dht
    from swarm.fabric.learner_group import LearnerGroup

    dhts, groups = [], []
    try:
        for i in range(3):
            dht, _ = start_dht("learners", initial_peers=[str(a) for a in dhts[0].get_visible_maddrs()] if dhts else [],
                               host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            dhts.append(dht)
        params = [torch.nn.Parameter(torch.zeros(300, 17)), torch.nn.Parameter(torch.zeros(5))]
        groups = [LearnerGroup(d, "learners", params, matchmaking_s=1.0, request_timeout_s=0.8) for d in dhts]
        yield groups, params
    finally:
        for g in groups:
            g.close()
        for d in dhts:
            d.shutdown()


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
    assert rs.grads is None and len(rs.members) == 1 and rs.error  # the stranger found nobody to average with
    # the stranger cannot take the learners' state either
    a.serve_state(lambda: ({"version": 1}, [torch.ones(2)]), 1)
    assert stranger.download_state([a.peer_id], timeout_s=5) is None
    got = b.download_state([a.peer_id], timeout_s=10)
    assert got is not None and got[1] == {"version": 1} and torch.equal(got[2][0], torch.ones(2))


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
