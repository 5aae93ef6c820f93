"""A learner's announcement pushed to the samplers it names as sharers (swarm/fabric/weights/announcement_push.py):
what a receiver accepts (only a push whose signature holds, by a key that may publish the run),
and, on real swarms over both transports, that a named sampler fetches the version at once, with
no look at the announcements, while a stranger's push changes nothing."""

import random
import time

import torch
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.waiting import wait_until
from swarm.fabric.weights.announcement_push import (
    MAX_PUSH_AGE_S,
    MAX_PUSH_BYTES,
    PUSH_OP,
    AnnouncementPusher,
    answer_push,
    push_request,
    read_push,
)
from swarm.fabric.weights.follower import VersionFollower
from swarm.fabric.signing import owner_key, verify_owner_signature
from swarm.fabric.grpc.common import pack
from swarm.fabric.weights.announcements import RunSampling, VersionAnnouncement
from swarm.fabric.weights.versions import VersionStore
from swarm.staleness import SecondsDelay

RUN = "push-test"


def announcement(version: int = 3, run_id: str = RUN, sharers=("peer-a", "peer-b"), age_s: float = 0.0) -> VersionAnnouncement:
    return VersionAnnouncement.of(run_id, version, "ab" * 32, "learner-peer", time.time() - age_s, RunSampling(),
                                  chunks=(), sharers=sharers)


def test_a_push_is_read_only_when_its_signature_holds_for_a_key_that_may_publish_the_run():
    learner, stranger = RSAPrivateKey(), RSAPrivateKey()
    keys = [owner_key(learner)]
    good = push_request(learner, announcement())
    assert good["op"] == PUSH_OP
    ann = read_push(good, keys, RUN)
    assert ann is not None and (ann.version, ann.peer_id, ann.sharers) == (3, "learner-peer", ("peer-a", "peer-b"))
    # a changed payload, a stranger's key, a stranger's key posing as the learner's, another run
    tampered = dict(good, payload=good["payload"].replace(b"learner-peer", b"evil-peer!!!"))
    posing = dict(push_request(stranger, announcement()), owner=owner_key(learner))
    assert read_push(tampered, keys, RUN) is None
    assert read_push(push_request(stranger, announcement()), keys, RUN) is None
    assert read_push(posing, keys, RUN) is None
    assert read_push(push_request(learner, announcement(run_id="other-run")), keys, RUN) is None
    # signed longer ago than an announcement lives (a replay after a restart), or in the future
    assert read_push(push_request(learner, announcement(age_s=MAX_PUSH_AGE_S - 5)), keys, RUN) is not None
    assert read_push(push_request(learner, announcement(age_s=MAX_PUSH_AGE_S + 5)), keys, RUN) is None
    assert read_push(push_request(learner, announcement(age_s=-3 * MAX_PUSH_AGE_S)), keys, RUN) is None
    # malformed fields, and more bytes than an announcement can take, however well signed
    assert read_push(dict(good, payload="text"), keys, RUN) is None
    assert read_push({"op": PUSH_OP}, keys, RUN) is None
    big = pack(dict(announcement().dict(), padding="x" * MAX_PUSH_BYTES))
    assert verify_owner_signature(owner_key(learner), big, learner.sign(big))
    assert read_push(dict(good, payload=big, signature=learner.sign(big)), keys, RUN) is None


def test_a_server_answers_a_push_by_what_its_follower_made_of_it():
    request = push_request(RSAPrivateKey(), announcement())
    assert not answer_push(None, request)["ok"]  # a peer that follows nobody
    assert answer_push(lambda r: True, request) == {"ok": True, "count": 0}
    assert not answer_push(lambda r: False, request)["ok"]

    def broken(r):
        raise RuntimeError("boom")

    assert not answer_push(broken, request)["ok"]  # an error in the follower is an answer, not a crash


def test_a_pusher_sends_each_version_once_to_each_sharer_and_skips_one_that_did_not_answer():
    told = []

    class Client:
        def tell(self, peer, request, timeout):
            told.append((peer, read_push(request, [owner_key(key)], RUN).version))
            if peer == "peer-c":
                raise ConnectionError("nobody there")
            return {"ok": peer == "peer-a"}

    key = RSAPrivateKey()
    made = []
    pusher = AnnouncementPusher(key, lambda: made.append(1) or Client())
    try:
        pusher.push(announcement(sharers=()))  # nobody named: no client made, nothing sent
        assert made == []
        for _ in range(3):  # an announcement repeats at every heartbeat
            pusher.push(announcement(version=3, sharers=("peer-a", "peer-b", "peer-c")))
        wait_until(lambda: pusher.sent == 3, 10, "three pushes")
        assert sorted(told) == [("peer-a", 3), ("peer-b", 3), ("peer-c", 3)] and made == [1]
        assert (pusher.answered, pusher.taken) == (2, 1)  # peer-b refused it, peer-c did not answer
        pusher.push(announcement(version=4, sharers=("peer-a", "peer-b", "peer-c")))
        wait_until(lambda: pusher.sent == 5, 10, "the next version's pushes")
        assert sorted(told[3:]) == [("peer-a", 4), ("peer-b", 4)]  # not to the peer that did not answer
    finally:
        pusher.close()


def test_a_pushed_announcement_never_fails_the_announcement():
    def no_client():
        raise OSError("no daemon to attach to")

    pusher = AnnouncementPusher(RSAPrivateKey(), no_client)
    pusher.push(announcement())  # the client fails on the push thread: nothing raised here
    wait_until(lambda: pusher.sent == 2, 10, "both pushes tried")
    assert pusher.answered == 0
    pusher.close()
    pusher.push(announcement(version=4))  # after close, still no exception


class QuietSampler:
    """A sampler whose follower looks at the announcements once at its start and then only every
    minute, counting its looks: a version it fetches before a minute is up came by a push."""

    def __init__(self, fabric, learner_key: bytes):
        self.fabric, self.store = fabric, VersionStore()
        self.server = fabric.weight_server(self.store)
        self.looks, self.looks_at_fetch = 0, []
        lookup = fabric.latest_announced

        def latest_announced(keys):
            self.looks += 1
            return lookup(keys)

        fabric.latest_announced = latest_announced
        self.follower = VersionFollower(fabric, self.store, [learner_key], SecondsDelay.parse("none"), random.Random(0),
                                        echo=lambda m: None, on_fetch=lambda r: self.looks_at_fetch.append(self.looks),
                                        poll_s=60.0)

    def close(self):
        self.follower.close()
        self.server.close()


def test_a_named_sampler_fetches_a_pushed_version_without_looking_and_ignores_a_strangers(make_fabric):
    learner, stranger = make_fabric(), make_fabric()
    sampler = QuietSampler(make_fabric(), learner.public_key)
    store = VersionStore()
    server = learner.weight_server(store)
    try:
        wait_until(lambda: sampler.looks >= 1, 30, "the sampler's first look")
        # a stranger's signed push names a newer version: refused, and nothing is fetched
        stranger.announce(7, "cd" * 32, sharers=[sampler.fabric.peer_id])
        wait_until(lambda: stranger.pusher.sent == 1, 30, "the stranger's push")
        assert (stranger.pusher.answered, stranger.pusher.taken) == (1, 0)  # answered, and refused
        assert sampler.follower.newest is None
        store.add(0, {"w": torch.arange(64, dtype=torch.float32)})
        assert learner.announce(0, store.hashes[0], sharers=[sampler.fabric.peer_id])
        # long before its next look, a minute on, and with no look at the announcements
        wait_until(lambda: sampler.store.latest == 0, 30, "the pushed version at the sampler")
        assert sampler.looks_at_fetch == [1]
        assert learner.pusher.taken == 1
    finally:
        sampler.close()
        server.close()
