"""A learner's announcement pushed to the samplers it names as sharers (swarm/fabric/announcement_push.py):
what a receiver accepts (only a push whose signature holds, by a key that may publish the run),
and, on real swarms over both transports, that a named sampler fetches the version at once, with
no look at the announcements, while a stranger's push changes nothing."""

import random
import threading
import time

import torch
from hivemind.utils.crypto import RSAPrivateKey

from swarm.fabric.announcement_push import (
    MAX_PUSH_BYTES,
    PUSH_OP,
    AnnouncementPusher,
    answer_push,
    push_request,
    read_push,
)
from swarm.fabric.follower import VersionFollower
from swarm.fabric.grpc_common import owner_key
from swarm.fabric.records import RunSampling, VersionAnnouncement
from swarm.fabric.versions import VersionStore
from swarm.staleness import SecondsDelay

RUN = "push-test"


def announcement(version: int = 3, run_id: str = RUN, sharers=("peer-a", "peer-b")) -> VersionAnnouncement:
    return VersionAnnouncement.of(run_id, version, "ab" * 32, "learner-peer", time.time(), RunSampling(),
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
    # malformed fields, and more bytes than an announcement can take
    assert read_push(dict(good, payload="text"), keys, RUN) is None
    assert read_push({"op": PUSH_OP}, keys, RUN) is None
    assert read_push(dict(good, signature=good["signature"] + b"x" * MAX_PUSH_BYTES), keys, RUN) is None


def test_a_server_answers_a_push_by_what_its_follower_made_of_it():
    request = push_request(RSAPrivateKey(), announcement())
    assert not answer_push(None, request)["ok"]  # a peer that follows nobody
    assert answer_push(lambda r: True, request) == {"ok": True, "count": 0}
    assert not answer_push(lambda r: False, request)["ok"]

    def broken(r):
        raise RuntimeError("boom")

    assert not answer_push(broken, request)["ok"]  # an error in the follower is an answer, not a crash


def test_a_pusher_sends_each_version_once_to_each_sharer():
    told, done = [], threading.Event()

    class Client:
        def tell(self, peer, request, timeout):
            told.append((peer, read_push(request, [owner_key(key)], RUN).version))
            if len(told) == 2:
                done.set()
            return {"ok": peer == "peer-a"}

    key = RSAPrivateKey()
    made = []
    pusher = AnnouncementPusher(key, lambda: made.append(1) or Client())
    try:
        pusher.push(announcement(sharers=()))  # nobody named: no client made, nothing sent
        assert made == []
        for _ in range(3):  # an announcement repeats at every heartbeat
            pusher.push(announcement(version=3))
        assert done.wait(10)
        time.sleep(0.2)
        assert sorted(told) == [("peer-a", 3), ("peer-b", 3)] and made == [1]
        assert (pusher.sent, pusher.taken) == (2, 1)
    finally:
        pusher.close()


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


def wait_until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


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
        assert stranger.pusher.taken == 0 and sampler.follower.newest is None
        store.add(0, {"w": torch.arange(64, dtype=torch.float32)})
        started = time.monotonic()
        assert learner.announce(0, store.hashes[0], sharers=[sampler.fabric.peer_id])
        wait_until(lambda: sampler.store.latest == 0, 30, "the pushed version at the sampler")
        assert time.monotonic() - started < 30  # long before its next look, a minute on
        assert sampler.looks_at_fetch == [1]  # fetched with no look at the announcements
        assert learner.pusher.taken == 1
        learner.announce(0, store.hashes[0], sharers=[sampler.fabric.peer_id])  # the next heartbeat's
        time.sleep(0.5)
        assert learner.pusher.sent == 1  # pushed once per version
    finally:
        sampler.close()
        server.close()
