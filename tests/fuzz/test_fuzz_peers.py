"""Fuzzing of the peers end to end, over real loopback servers of both transports (the fuzz
strategies and invariants are test_fuzz.py's): the rollout inbox under streams of mutated frames,
the weight server under mutated requests, and the gRPC registry server under signed requests with
mutated bodies. After each, the peer still serves valid requests and has accepted nothing invalid."""

from __future__ import annotations

import asyncio
import math
import time

import msgpack
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from swarm.fabric.rollouts.bans import PeerBans
from swarm.fabric.grpc.common import SERVICE, pack, unpack
from swarm.fabric.membership.records import Heartbeat
from swarm.fabric.weights.versions import VersionStore
from swarm.fabric.weights.delta import apply_payload, state_hash
from swarm.fabric.rollouts.wire import encode_group
from swarm.rollouts import RolloutGroup
from tests.fuzz.test_fuzz import (ANY_FRAME, LEARNER_VERSION, LIMITS, MAX_STALENESS, RUN, SAFE_EDGE_INTS, SAFE_INTS, SAFE_WEIRD, VOCAB,
                       assert_registry_sound, assert_valid_group, drain, fuzz, mutated_requests, random_requests, scalars)

# ---------------------------------------------------------------------------------------------
# real transports, end to end

def weight_states():
    gen = torch.Generator().manual_seed(3)
    v0 = {"w": torch.randn(6, 4, generator=gen).to(torch.bfloat16), "b": torch.randn(4, generator=gen)}
    v1 = {k: v.clone() for k, v in v0.items()}
    v1["w"][0, 0] += 1
    v2 = {k: v + 1 for k, v in v1.items()}
    return [v0, v1, v2]


class Swarm:
    """A registry or DHT node, a learner (rollout inbox and weight server), a fuzzing sender and an
    honest peer, all real, on loopback."""

    def __init__(self, transport: str) -> None:
        from swarm.fabric.local import LocalFabrics

        self.transport = transport
        self.fabrics = LocalFabrics(transport, RUN)
        try:
            self.learner, self.fuzzer, self.honest = (self.fabrics.make() for _ in range(3))
            self.inbox = self.learner.rollout_inbox(vocab_size=VOCAB, max_staleness=MAX_STALENESS, capacity=512,
                                                    put_timeout_s=0.5, limits=LIMITS,
                                                    bans=PeerBans(strikes=60, window_s=600, ban_s=600))
            self.inbox.learner_version = LEARNER_VERSION
            self.sender = self.fuzzer.rollout_sender(timeout_s=30)
            self.store = VersionStore(capacity=8)
            for version, state in enumerate(weight_states()):
                self.store.add(version, state)
            self.weights = self.learner.weight_server(self.store)
        except BaseException:
            self.fabrics.close()
            raise

    def close(self) -> None:
        try:
            for part in (self.sender, self.inbox, self.weights):
                part.close()
        finally:
            self.fabrics.close()


@pytest.fixture(scope="module", params=["grpc", "hivemind"])
def swarm(request):
    started = Swarm(request.param)
    yield started
    started.close()


def test_rollout_inbox_survives_fuzzed_streams(swarm):
    sent, oks, banned = 0, 0, False

    @fuzz(8)
    @given(batch=st.lists(ANY_FRAME, min_size=25, max_size=45))
    def fuzz_batch(batch):
        nonlocal sent, oks, banned
        acks = swarm.sender.send_frames(swarm.learner.peer_id, batch)
        assert isinstance(acks, list) and len(acks) == len(batch)
        for ack in acks:
            assert isinstance(ack, dict) and isinstance(ack.get("ok"), bool), ack
            if banned:
                assert not ack["ok"] and "banned" in ack["reason"]  # banned for 600 s: no way back meanwhile
            banned = banned or (not ack["ok"] and "banned" in ack["reason"])
        sent, oks = sent + len(batch), oks + sum(a["ok"] for a in acks)
        groups = drain(swarm.inbox)
        assert len(groups) == sum(a["ok"] for a in acks)  # every accepted group, and nothing else, was queued
        for group in groups:
            assert_valid_group(group)
            assert group.sender == swarm.fuzzer.peer_id

    fuzz_batch()
    assert sent >= 8 * 25
    # an oversized frame: refused with the reason (hivemind, which cannot resynchronise, refuses the rest of the stream)
    acks = swarm.sender.send_frames(swarm.learner.peer_id, [bytes(LIMITS.max_frame_bytes + 1)])
    assert len(acks) == 1 and not acks[0]["ok"] and f"exceeds {LIMITS.max_frame_bytes}" in acks[0]["reason"], acks
    assert drain(swarm.inbox) == []

    # the inbox still serves: a valid group from a peer in good standing arrives intact
    group = RolloutGroup(problem_id="after-fuzz", prompt_ids=[1, 2], completion_ids=[[3, 4], [5]],
                         sampler_logprobs=[[-0.5, -0.25], [-1.0]], rewards=[1.0, None], version=LEARNER_VERSION,
                         sampler_id="honest", completion_texts=["a", "b"], temperature=0.7, top_k=5, top_p=0.9)
    honest = swarm.honest.rollout_sender(timeout_s=30)
    try:
        assert honest.send(swarm.learner.peer_id, [group]) == [{"ok": True}]
    finally:
        honest.close()
    received = swarm.inbox.get(timeout=10)
    assert received is not None and received.sender == swarm.honest.peer_id
    assert (received.problem_id, received.completion_ids, received.rewards) == ("after-fuzz", [[3, 4], [5]], [1.0, None])
    # and the fuzzer still gets answers (refusals, once banned)
    acks = swarm.sender.send_frames(swarm.learner.peer_id, [encode_group(group)])
    assert len(acks) == 1 and isinstance(acks[0].get("ok"), bool)
    drain(swarm.inbox)


# version numbers, and what a careless or hostile peer puts in their place
WANTS = st.one_of(st.integers(-2, 4), st.sampled_from(("1", "2", b"1", "x", "9" * 5000, 1.0, 2.9, -0.5)),
                  scalars(SAFE_INTS, SAFE_EDGE_INTS))
WEIGHT_REQUESTS = st.one_of(
    st.fixed_dictionaries({"have": WANTS, "want": WANTS}),
    st.fixed_dictionaries({"want": WANTS}),
    st.dictionaries(st.sampled_from(("have", "want", "x")), WANTS, max_size=3),
)
RAW_WEIGHT_REQUESTS = st.one_of(WEIGHT_REQUESTS.map(pack), SAFE_WEIRD.map(pack), st.binary(max_size=40))


_last_stamp = [0.0]


def signed_metadata(fabric, path: str, body: bytes):
    """The fabric's signature of a call, stamped at least 5 ms after the previous one: two identical
    requests signed within one millisecond carry one signature, and the second is refused as a
    replay (rightly; that is not what these tests look at)."""
    _last_stamp[0] = max(time.time(), _last_stamp[0] + 0.005)
    return fabric.signer.metadata(path, body, now=_last_stamp[0])


def grpc_weight_request(swarm, raw: bytes):
    """(header, payloads) from the learner's gRPC weight server (the request signed by the fuzzing
    peer, as any peer's is), or the gRPC status it refused the call with."""
    import grpc

    path = f"/{SERVICE}.Peer/Weights"
    call = swarm.fuzzer.channels.get(swarm.learner.peer_id).stream_stream(path, request_serializer=None,
                                                                          response_deserializer=None)
    try:
        messages = list(call(iter([raw]), timeout=20, metadata=signed_metadata(swarm.fuzzer, path, raw)))
    except grpc.RpcError as exc:
        assert exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED, "the weight server did not answer"
        return exc.code(), None
    header = unpack(messages[0])
    chunks = b"".join(messages[1:])
    payloads, at = [], 0
    for size in header.get("sizes", []) if isinstance(header, dict) else []:
        payloads.append(chunks[at:at + size])
        at += size
    assert at == len(chunks)
    return header, payloads


def hivemind_weight_request(swarm, client, raw: bytes):
    """(header, payloads) from the learner's p2p weight server, or "closed" when it dropped the stream."""
    from hivemind.p2p import P2P

    async def ask():
        reader, writer = await client.open(swarm.learner.peer_id)
        try:
            try:
                await P2P.send_raw_data(raw, writer)
            except ConnectionError:  # a request over the server's limit: refused, maybe before it was all sent
                if len(raw) <= 1024:
                    raise
                return "closed", None
            try:
                header = msgpack.unpackb(await P2P.receive_raw_data(reader), raw=False)
            except asyncio.IncompleteReadError:
                return "closed", None
            count = header.get("count", 0) if isinstance(header, dict) and header.get("ok") else 0
            return header, [await P2P.receive_raw_data(reader) for _ in range(count)]
        finally:
            writer.close()

    return client.run(asyncio.wait_for(ask(), 20), timeout=30)


def test_weight_server_survives_fuzzed_requests(swarm):
    from swarm.fabric.hivemind.loop import StreamClient
    from swarm.fabric.hivemind.weights import handler_name

    client = None
    if swarm.transport == "hivemind":
        client = StreamClient(swarm.fuzzer.dht, handler_name(RUN), thread_name="fuzz-weights")
    answered = 0

    @fuzz(60)
    @given(raw=RAW_WEIGHT_REQUESTS)
    @example(raw=pack({"have": 0, "want": 1}))
    @example(raw=pack({"have": None, "want": math.inf}))  # smallest failures found (hivemind's server)
    @example(raw=pack([]))
    @example(raw=b"\xc1")
    def fuzz_request(raw):
        nonlocal answered
        header, payloads = (grpc_weight_request(swarm, raw) if client is None else hivemind_weight_request(swarm, client, raw))
        if len(raw) <= 1024:  # a request of a size any peer may send is answered, whatever it says, never dropped
            assert isinstance(header, dict) and isinstance(header.get("ok"), bool), f"{raw!r} got {header!r}"
        if not isinstance(header, dict):
            return  # an oversized request, refused by the transport
        answered += 1
        if header["ok"]:  # what is served rebuilds exactly the version asked for
            request = unpack(raw)
            state, want = None, int(request["want"])
            have = request.get("have")
            if isinstance(have, int) and 0 <= have < want:
                state = swarm.store.states[have]
            for payload in payloads:
                _, state = apply_payload(payload, state)
            assert state_hash(state) == swarm.store.hashes[want]
        else:
            assert isinstance(header.get("reason"), str)

    try:
        fuzz_request()
        assert answered > 0
        # and a valid fetch still works, from a peer holding nothing and from one holding version 0
        for held in ([], [0]):
            store = VersionStore()
            for version in held:
                store.add(version, swarm.store.states[version])
            weights = swarm.honest.weight_client(timeout_s=30)
            try:
                result = weights.fetch(swarm.learner.peer_id, 2, swarm.store.hashes[2], store)
            finally:
                weights.close()
            assert result.version == 2 and store.hashes[2] == swarm.store.hashes[2]
    finally:
        if client is not None:
            client.close()


REGISTRY_METHODS = {"Heartbeat": "heartbeat", "Announce": "announce", "Members": "list_members", "Versions": "list_versions"}


@pytest.mark.parametrize("swarm", ["grpc"], indirect=True)  # over hivemind, records live in the DHT (its own validators)
def test_registry_server_survives_fuzzed_signed_requests(swarm):
    """Requests signed by a real peer (so they pass authentication and reach the handlers), with
    fuzzed bodies: the registry answers each with a map, and afterwards still takes and lists
    valid records."""
    import grpc

    fuzzer = swarm.fuzzer
    channel = fuzzer.channels.get(swarm.fabrics.bootstrap.addresses()[0])
    sent = 0

    @fuzz(50)
    @given(method=st.sampled_from(sorted(REGISTRY_METHODS)), data=st.data())
    def fuzz_call(method, data):
        nonlocal sent
        request, _ = data.draw(mutated_requests(REGISTRY_METHODS[method]) | random_requests())
        if isinstance(request, dict) and data.draw(st.booleans()):
            request["run_id"] = RUN  # the run the call is signed for: the request reaches the handler
            if method == "Heartbeat" and isinstance(request.get("record"), dict) and data.draw(st.booleans()):
                request["record"]["peer_id"] = fuzzer.peer_id
        path, body = f"/{SERVICE}.Registry/{method}", pack(request)
        call = channel.stream_unary(path, request_serializer=None, response_deserializer=unpack)
        try:
            reply = call(iter([body]), timeout=20, metadata=signed_metadata(fuzzer, path, body))
        except grpc.RpcError as exc:  # refusing a request is an answer; an exception in a handler is not
            assert exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED), exc
            return
        assert isinstance(reply, dict)
        sent += 1

    fuzz_call()
    assert sent > 0
    assert fuzzer.heartbeat(Heartbeat(role="sampler", model="after-fuzz"))
    members = {m.record.peer_id: m for m in swarm.fabrics.bootstrap.members()}
    assert members[fuzzer.peer_id].record.model == "after-fuzz"
    assert all(math.isfinite(m.expires_at) for m in members.values())
    registry = swarm.fabrics.bootstrap.registry
    assert_registry_sound(registry, {RUN}, now=time.time())
