"""Rollout groups over both transports (real hivemind p2p streams, real gRPC servers): intact
delivery, refusal with reasons, at-most-once delivery, backpressure, bans."""

import math
import time

import msgpack
import pytest

from swarm.fabric.rollouts.wire import InvalidRollout, decode_group, encode_group
from swarm.rollouts import RolloutGroup


def wait_until(condition, timeout: float) -> bool:
    """Poll `condition` until it holds or `timeout` seconds pass; whether it held."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True

RUN = "exchange-test"
VOCAB = 99


def group(version=3, **overrides):
    fields = dict(
        problem_id="arith-d2-1+2", prompt_ids=[10, 11, 12], completion_ids=[[4, 5, 1], [6, 1]],
        sampler_logprobs=[[-0.5, -0.25, -0.125], [-1.0, -2.0]], rewards=[1.0, None], version=version,
        sampler_id="sampler-a", completion_texts=["\\boxed{3}", "x"], temperature=0.7, top_k=5, top_p=0.9,
    )
    fields.update(overrides)
    return RolloutGroup(**fields)


def test_wire_round_trip_is_exact():
    original = group()
    uid, decoded = decode_group(encode_group(original, uid="u1"), vocab_size=VOCAB, learner_version=5, max_staleness=64)
    assert uid == "u1"
    for name in ("problem_id", "prompt_ids", "completion_ids", "sampler_logprobs", "rewards", "version", "sampler_id",
                 "completion_texts", "temperature", "top_k", "top_p", "created_at"):
        assert getattr(decoded, name) == pytest.approx(getattr(original, name)) if name == "temperature" else getattr(decoded, name) == getattr(original, name), name


def tampered(**changes):
    obj = msgpack.unpackb(encode_group(group(), uid="t"), raw=False)
    obj.update(changes)
    return msgpack.packb(obj, use_bin_type=True)


BAD = [
    (encode_group(group(completion_ids=[[4, 5, 120], [6, 1]])), "outside the vocabulary"),
    (encode_group(group(version=9)), "from the future"),
    (encode_group(group(version=0, sampler_logprobs=[[-0.5, -0.25, -0.125], [-1.0, -2.0]])), None),  # fine at staleness 5
    (encode_group(group(sampler_logprobs=[[-0.5, math.nan, -0.1], [-1.0, -2.0]])), "finite"),
    (encode_group(group(rewards=[1.0])), "need 2 rewards"),
    (tampered(cl=[3, 3]), "lengths sum to 6"),
    (tampered(v=7), "wire format version 7"),
    (tampered(ver=-1), "version must be an int >= 0"),
    (tampered(sid=""), "'sid' must be a non-empty string"),
    (b"\x93garbage", "not a msgpack map"),
]


@pytest.mark.parametrize("frame, reason", BAD, ids=[str(reason) for _, reason in BAD])  # frames hold fresh uuids and times: ids from the reasons, the same in every xdist worker
def test_wire_validation_names_the_problem(frame, reason):
    if reason is None:
        decode_group(frame, vocab_size=VOCAB, learner_version=5, max_staleness=64)
        return
    with pytest.raises(InvalidRollout, match=reason):
        decode_group(frame, vocab_size=VOCAB, learner_version=5, max_staleness=64)


def test_too_stale_groups_are_refused():
    with pytest.raises(InvalidRollout, match="70 steps stale"):
        decode_group(encode_group(group(version=0)), vocab_size=VOCAB, learner_version=70, max_staleness=64)


def test_groups_arrive_intact_once_and_bad_ones_are_refused_with_reasons(make_fabric):
    learner, sampler = make_fabric(), make_fabric()
    inbox = learner.rollout_inbox(vocab_size=VOCAB, max_staleness=64)
    inbox.learner_version = 5
    sender = sampler.rollout_sender(timeout_s=60)
    try:
        originals = [group(version=v, problem_id=f"p{v}") for v in (3, 4, 5)]
        acks = sender.send(learner.peer_id, originals)
        assert acks == [{"ok": True}] * 3
        received = [inbox.get(timeout=10) for _ in originals]
        assert [(g.problem_id, g.version, g.completion_ids, g.rewards) for g in received] == [
            (g.problem_id, g.version, g.completion_ids, g.rewards) for g in originals]
        assert received[0].sampler_logprobs == originals[0].sampler_logprobs
        assert received[0].sender == sampler.peer_id

        frame = encode_group(group(problem_id="dup"), uid="same-uid")
        bad = encode_group(group(completion_ids=[[4, 5, 500], [6, 1]]))
        acks = sender.send_frames(learner.peer_id, [frame, frame, bad, b"junk"])
        assert acks[0] == {"ok": True}
        assert acks[1] == {"ok": False, "reason": "duplicate"}
        assert not acks[2]["ok"] and "outside the vocabulary" in acks[2]["reason"]
        assert not acks[3]["ok"] and "msgpack" in acks[3]["reason"]
        assert inbox.get(timeout=10).problem_id == "dup"
        assert inbox.get(timeout=0.5) is None  # nothing else was let through
        assert inbox.stats.refused[sampler.peer_id] == 2 and inbox.stats.duplicates == 1
        assert inbox.stats.accepted["sampler-a"] == 4
    finally:
        sender.close()
        inbox.close()


def test_backpressure_bounds_the_learners_memory(make_fabric):
    learner, sampler = make_fabric(), make_fabric()
    inbox = learner.rollout_inbox(vocab_size=VOCAB, capacity=2, put_timeout_s=1.0)
    inbox.learner_version = 3
    sender = sampler.rollout_sender(timeout_s=60)
    try:
        acks = sender.send(learner.peer_id, [group(problem_id=f"p{i}") for i in range(4)])
        assert [a["ok"] for a in acks] == [True, True, False, False]
        assert all(a["reason"] == "busy" for a in acks[2:])
        assert inbox.qsize() == 2
        # once the learner catches up, the refused groups can be sent again
        assert inbox.get(timeout=5) and inbox.get(timeout=5)
        assert [a["ok"] for a in sender.send(learner.peer_id, [group(problem_id="p2")])] == [True]
    finally:
        sender.close()
        inbox.close()


def test_a_peer_sending_garbage_is_banned_then_ignored(make_fabric):
    from swarm.fabric.rollouts.bans import PeerBans

    learner, sampler, honest = make_fabric(), make_fabric(), make_fabric()
    inbox = learner.rollout_inbox(vocab_size=VOCAB, bans=PeerBans(strikes=3, window_s=60, ban_s=60))
    inbox.learner_version = 3
    sender, good = sampler.rollout_sender(timeout_s=60), honest.rollout_sender(timeout_s=60)
    try:
        acks = sender.send_frames(learner.peer_id, [b"junk"] * 3 + [encode_group(group())])
        assert [a["ok"] for a in acks] == [False] * 4 and "banned" in acks[3]["reason"]  # even a valid group, now
        assert good.send(learner.peer_id, [group()]) == [{"ok": True}]  # others are not affected
        assert inbox.bans.banned() == [sampler.peer_id]
    finally:
        sender.close()
        good.close()
        inbox.close()


@pytest.mark.parametrize("make_fabric", ["hivemind"], indirect=True)  # gRPC: tests/fabric/grpc/test_grpc_hostile.py
def test_streams_past_a_peers_limit_are_refused_and_idle_ones_cut(make_fabric):
    """One peer holding streams open cannot take the learner's streams or its memory: past
    StreamLimits.per_peer a stream is refused with the reason, an idle one is cut after idle_s,
    and another peer's groups go through meanwhile."""
    import asyncio

    from hivemind.p2p import P2P

    from swarm.fabric.rollouts.inbox import StreamLimits

    learner, hog, honest = make_fabric(), make_fabric(), make_fabric()
    inbox = learner.rollout_inbox(vocab_size=VOCAB, streams=StreamLimits(per_peer=2, idle_s=1.5))
    inbox.learner_version = 3
    holder, good = hog.rollout_sender(timeout_s=60), honest.rollout_sender(timeout_s=60)

    async def first_frame_or_eof(reader):
        try:
            return msgpack.unpackb(await asyncio.wait_for(P2P.receive_raw_data(reader), 10), raw=False)
        except asyncio.IncompleteReadError:
            return None  # the learner closed it without a word: cut as idle

    async def hold_three_streams():
        streams = [await holder._client.open(learner.peer_id) for _ in range(3)]
        # the learner's handlers may run in any order: whichever stream comes third is refused at
        # once with the reason (wait for that before going on), the other two are held
        for _ in range(200):
            if inbox.stats.reasons["too many streams"]:
                break
            await asyncio.sleep(0.05)
        # another peer's groups go through while they are held
        acks = await asyncio.get_running_loop().run_in_executor(None, good.send, learner.peer_id, [group()])
        assert acks == [{"ok": True}]
        # the two held streams are cut once idle: their reads end without a frame
        answers = await asyncio.gather(*(first_frame_or_eof(reader) for reader, _ in streams))
        for _, writer in streams:
            writer.close()
        refusals = [a for a in answers if a is not None]
        assert len(refusals) == 1, answers
        return refusals[0]

    try:
        refusal = holder._client.run(hold_three_streams(), timeout=30)
        assert refusal["ok"] is False and "more than 2 open rollout streams" in refusal["reason"]
        assert inbox.stats.reasons["too many streams"] == 1 and inbox.stats.reasons["slow sender"] == 2
        assert inbox.bans.banned() == []  # a slow or busy peer is not a hostile one
    finally:
        holder.close()
        good.close()
        inbox.close()


@pytest.mark.parametrize("make_fabric", ["hivemind"], indirect=True)  # gRPC acks every frame it refuses
def test_a_stream_refused_whole_tells_the_sender_why_for_every_frame(make_fabric):
    """A stream the learner refuses whole (past a peer's stream limit) or from a frame on (an
    oversized one, which it cannot skip) answers every frame with the reason, and the learner
    lingers for the sender to read it: the sampler learns why, not that the learner was
    unreachable, and what was accepted before the refusal stays accepted."""
    from swarm.fabric.rollouts.inbox import StreamLimits
    from swarm.fabric.rollouts.wire import WireLimits

    learner, hog = make_fabric(), make_fabric()
    inbox = learner.rollout_inbox(vocab_size=VOCAB, streams=StreamLimits(per_peer=1, idle_s=20),
                                  limits=WireLimits(max_frame_bytes=64 * 1024))
    inbox.learner_version = 3
    sender = hog.rollout_sender(timeout_s=30)
    try:
        frames = [encode_group(group(problem_id=f"p{i}")) for i in range(3)]
        # a frame too big in the middle: the first is accepted, it and the one after it are refused
        acks = sender.send_frames(learner.peer_id, [frames[0], bytes(64 * 1024 + 1), frames[1]])
        assert acks[0] == {"ok": True}, acks
        assert [a["ok"] for a in acks] == [True, False, False]
        assert all("exceeds 65536" in a["reason"] for a in acks[1:]), acks
        received = inbox.get(timeout=10)
        assert received is not None and received.problem_id == "p0" and inbox.get(timeout=0.5) is None

        async def close(writer):
            writer.close()

        # the refused stream counts until the learner sees the sender's end close: wait for that,
        # or the holder's stream would be the one refused
        assert wait_until(lambda: inbox.open_streams() == 0, timeout=10), inbox.open_streams()
        holder = hog.rollout_sender(timeout_s=30)  # the same peer: its one stream makes the sender's next one refused
        _, held = holder._client.run(holder._client.open(learner.peer_id), timeout=20)
        try:
            # the learner counts a stream when its handler runs, a moment after the opener returns
            assert wait_until(lambda: inbox.open_streams() == 1, timeout=10), inbox.open_streams()
            acks = sender.send_frames(learner.peer_id, frames)
        finally:
            holder._client.run(close(held), timeout=10)
            holder.close()
        assert [a["ok"] for a in acks] == [False] * 3
        assert all("more than 1 open rollout streams" in a["reason"] for a in acks), acks
        assert inbox.get(timeout=0.5) is None and inbox.stats.reasons["too many streams"] == 1
    finally:
        sender.close()
        inbox.close()
