"""The end of a run travels as versions do (issue 47): the learner's signed announcement says its last
version is the last, and only an announcement signed under the run's keys is believed. Real peers
over each transport."""

import time

from swarm.fabric.weights.announcements import newest_authorised


def wait_for(read, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = read()
        if found is not None:
            return found
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout:.0f}s")


def test_only_the_runs_learner_can_end_the_run(make_fabric):
    learner, stranger, sampler = make_fabric(), make_fabric(), make_fabric()
    assert learner.announce(3, "ab" * 32)
    # a stranger signs an end of the run, at a newer version: not the run's key, so not believed
    assert stranger.announce(9, "cd" * 32, ended=True)
    seen = wait_for(lambda: sampler.latest_announced([learner.public_key]), 30, "learner announcement")
    assert (seen.version, seen.ended) == (3, False)
    # the stranger's record is there, and ends the run for whoever took its key as the run's
    both = wait_for(lambda: sampler.latest_announced([stranger.public_key]), 30, "stranger announcement")
    assert (both.version, both.ended) == (9, True)

    assert learner.announce(3, "ab" * 32, ended=True)  # the learner's own end: its last version, marked
    ended = wait_for(lambda: (lambda a: a if a is not None and a.ended else None)(sampler.latest_announced([learner.public_key])),
                     30, "end of the run")
    assert ended.version == 3


def test_an_end_marked_under_another_key_or_malformed_is_ignored():
    owner, other = b"[owner:run-key]", b"[owner:someone-else]"
    good = {"run_id": "r", "version": 2, "hash": "ab" * 32, "peer_id": "p", "time": 1.0, "temperature": 1.0, "top_k": 0,
            "top_p": 1.0, "max_tokens": 8}
    assert newest_authorised([(other, {**good, "version": 5, "ended": True}), (owner, good)], [owner], "r").ended is False
    assert newest_authorised([(owner, {**good, "ended": True})], [owner], "r").ended is True
    # strict: "yes" or 1 is no end of the run, and the record is dropped whole
    assert newest_authorised([(owner, {**good, "ended": "yes"})], [owner], "r") is None
    assert newest_authorised([(owner, {**good, "ended": 1})], [owner], "r") is None
