"""The gRPC transport against a hostile peer, with real gRPC servers on loopback: peers are known by
the key that signs their requests, never by the address they claim, so garbage sent under an honest
sampler's address bans only the sender; unsigned, forged, stale, replayed and other-run calls are
refused before anything reads them; idle rollout streams past the learner's limits neither starve
weight requests nor keep honest samplers out for longer than StreamLimits.idle_s, and give their
server threads back; a receiver that stops reading weights is cut off; a holder that sends
oversized chunks or too many payloads is refused, and the next holder asked."""

import threading
import time

import grpc
import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.waiting import wait_until
from swarm.fabric.rollouts.bans import PeerBans
from swarm.fabric.weights.follower import fetch_from_holders
from swarm.fabric.grpc.common import CHUNK_BYTES, OWNER_HEADER, PEER_HEADER, SERVICE, RequestSigner, pack, peer_id_of, unpack
from swarm.fabric.signing import owner_key
from swarm.fabric.grpc.server import RESERVE_WORKERS, ROLLOUTS, GrpcPeerServer
from swarm.fabric.grpc.server import WEIGHTS
from swarm.fabric.grpc.weights import GrpcWeightServer
from swarm.fabric.grpc.rollouts import GrpcRolloutInbox, GrpcRolloutSender
from swarm.fabric.local import LocalFabrics
from swarm.fabric.rollouts.inbox import StreamLimits
from swarm.fabric.weights.versions import HEADER_LIMIT, MAX_HELD_VERSIONS, OversizedPayload, VersionStore, payload_limit
from swarm.fabric.weights.delta import CorruptVersion
from swarm.fabric.rollouts.wire import encode_group
from swarm.rollouts import RolloutGroup

RUN = "grpc-hostile-test"
VOCAB = 99


def group(problem_id: str = "p", version: int = 3) -> RolloutGroup:
    return RolloutGroup(problem_id=problem_id, prompt_ids=[10, 11, 12], completion_ids=[[4, 5, 1], [6, 1]],
                        sampler_logprobs=[[-0.5, -0.25, -0.125], [-1.0, -2.0]], rewards=[1.0, None], version=version,
                        sampler_id="sampler-a", completion_texts=["\\boxed{3}", "x"], temperature=0.7, top_k=5, top_p=0.9)


def small_state() -> dict:
    torch.manual_seed(0)
    return {"w": torch.randn(16, 8).to(torch.bfloat16), "b": torch.randn(16).to(torch.bfloat16)}


@pytest.fixture
def swarm():
    """make() -> a new real gRPC peer of one registry; all closed after the test."""
    with LocalFabrics("grpc", RUN) as fabrics:
        def make():
            return fabrics.make()

        make.registry = fabrics.bootstrap
        yield make


def claiming(fabric, address: str) -> GrpcRolloutSender:
    """A rollout sender signing with `fabric`'s key but claiming to serve at `address`."""
    return GrpcRolloutSender(fabric.channels, RequestSigner(fabric.signing_key, RUN, peer_id_of(fabric.key_id, address)), timeout_s=30)


def test_garbage_under_an_honest_samplers_address_bans_only_the_sender(swarm):
    learner, honest, attacker = swarm(), swarm(), swarm()
    inbox = learner.rollout_inbox(vocab_size=VOCAB, bans=PeerBans(strikes=3, window_s=60, ban_s=60))
    inbox.learner_version = 3
    forger, good = claiming(attacker, honest.server.address), honest.rollout_sender(timeout_s=30)
    try:
        acks = forger.send_frames(learner.peer_id, [b"junk"] * 3 + [encode_group(group("forged"))])
        assert [a["ok"] for a in acks] == [False] * 4 and "banned" in acks[3]["reason"]
        # the ban is the attacker's key's: its name shows the address it claimed, under its own key id
        assert inbox.bans.banned() == [peer_id_of(attacker.key_id, honest.server.address)]
        assert good.send(learner.peer_id, [group("honest")]) == [{"ok": True}]
        received = inbox.get(timeout=10)
        assert received.problem_id == "honest" and received.sender == honest.peer_id
        assert inbox.stats.refused[honest.peer_id] == 0
        # claiming another address does not lift the ban (a key goes by one name at the learner)
        acks = claiming(attacker, "127.0.0.1:1").send_frames(learner.peer_id, [encode_group(group("again"))])
        assert not acks[0]["ok"] and "banned" in acks[0]["reason"]
        # and claiming the honest sampler's whole peer id fails: its key id is not the attacker's
        impostor = GrpcRolloutSender(attacker.channels, RequestSigner(attacker.signing_key, RUN, honest.peer_id), timeout_s=30)
        acks = impostor.send_frames(learner.peer_id, [b"junk"] * 2)
        assert [a["ok"] for a in acks] == [False, False] and "not the signing key's" in acks[0]["reason"]
        assert inbox.bans.banned() == [peer_id_of(attacker.key_id, honest.server.address)]
        assert good.send(learner.peer_id, [group("still honest")]) == [{"ok": True}]
        assert inbox.get(timeout=10).problem_id == "still honest" and inbox.get(timeout=0.2) is None
    finally:
        inbox.close()


def forged_metadata(kind: str, attacker, victim, path: str, body: bytes):
    """Metadata of a call `attacker` makes, forged as `kind` says (None: no signature at all)."""
    signer = RequestSigner(attacker.signing_key, RUN, attacker.peer_id)
    if kind == "unsigned":
        return ()
    if kind in ("stale", "future"):
        return signer.metadata(path, body, now=time.time() + (-300 if kind == "stale" else 300))
    metadata = dict(signer.metadata(path, body))
    if kind == "another key":  # the victim's key named, the attacker's signature
        metadata[OWNER_HEADER] = owner_key(victim.signing_key)
    elif kind == "tampered":  # signed, then the claimed peer id changed
        metadata[PEER_HEADER] = peer_id_of(attacker.key_id, "127.0.0.1:2").encode()
    return tuple(metadata.items())


REFUSED = {"unsigned": "unsigned request", "another key": "bad signature", "tampered": "bad signature",
           "stale": "timestamp is -300s off", "future": "timestamp is +300s off"}


def call_raw(fabric, target: str, address: str, body: bytes, metadata):
    """One call to `target` (a registry or peer method) carrying `body`, with `metadata` as given."""
    channel = fabric.channels.get(address)
    if target == "Heartbeat":
        return channel.stream_unary(f"/{SERVICE}.Registry/Heartbeat", request_serializer=None,
                                    response_deserializer=unpack)(iter([body]), timeout=10, metadata=metadata)
    path = ROLLOUTS if target == "Rollouts" else WEIGHTS
    return list(channel.stream_stream(path, request_serializer=None, response_deserializer=None)(
        iter([body]), timeout=10, metadata=metadata))


def target_call(target: str, learner, attacker, registry_address: str):
    """(address, body, the path signed, what the body signs as) of a plausible call to `target`."""
    if target == "Heartbeat":
        from swarm.fabric.membership.records import Heartbeat

        record = Heartbeat(role="learner").record(attacker.peer_id, time.time()).dict()
        body = pack({"run_id": RUN, "record": record, "expiry_s": 30.0})
        return registry_address, body, f"/{SERVICE}.Registry/Heartbeat", body
    if target == "Rollouts":
        return learner.peer_id, encode_group(group("unsigned")), ROLLOUTS, b""  # a stream signs its opening only
    body = pack({"have": None, "want": 0})
    return learner.peer_id, body, WEIGHTS, body


@pytest.mark.parametrize("target", ["Heartbeat", "Rollouts", "Weights"])
def test_unsigned_forged_stale_replayed_and_other_run_calls_are_refused_unread(swarm, target):
    learner, victim, attacker = swarm(), swarm(), swarm()
    inbox = learner.rollout_inbox(vocab_size=VOCAB)
    inbox.learner_version = 3
    store = VersionStore()
    store.add(0, small_state())
    weights = learner.weight_server(store)
    registry_address = swarm.registry.addresses()[0]
    address, body, path, signed_body = target_call(target, learner, attacker, registry_address)
    try:
        for kind, reason in REFUSED.items():
            with pytest.raises(grpc.RpcError) as refused:
                call_raw(attacker, target, address, body, forged_metadata(kind, attacker, victim, path, signed_body))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, kind
            assert reason in refused.value.details(), (kind, refused.value.details())
        # a call signed for another run is refused too (the registry checks it against the request's run)
        other_run = RequestSigner(attacker.signing_key, "another-run", attacker.peer_id).metadata(path, signed_body)
        if target == "Heartbeat":
            reply = call_raw(attacker, target, address, body, other_run)
            assert not reply["ok"] and "naming the run it is signed for ('another-run')" in reply["reason"]
        else:
            with pytest.raises(grpc.RpcError, match="signed for run 'another-run'"):
                call_raw(attacker, target, address, body, other_run)
        # nothing of it reached the inbox, the weight server or the registry
        assert inbox.qsize() == 0 and not inbox.stats.refused and not inbox.stats.reasons and weights.served == 0
        assert [m.record.peer_id for m in swarm.registry.members()] == []
        # the same call, signed: it goes through once, and sent again it is a replay
        genuine = RequestSigner(attacker.signing_key, RUN, attacker.peer_id).metadata(path, signed_body)
        call_raw(attacker, target, address, body, genuine)
        with pytest.raises(grpc.RpcError) as replayed:
            call_raw(attacker, target, address, body, genuine)
        assert replayed.value.code() == grpc.StatusCode.UNAUTHENTICATED and "replayed" in replayed.value.details()
        delivered = {"Heartbeat": len(swarm.registry.members()), "Rollouts": inbox.qsize(), "Weights": weights.served}
        assert delivered[target] == 1
    finally:
        inbox.close()
        weights.close()


class IdleStreams:
    """Rollout streams that open, signed, and then send nothing until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = []

    def open(self, fabric, address: str):
        def nothing():
            self.release.wait(30)
            return
            yield

        call = fabric.channels.get(address).stream_stream(ROLLOUTS, request_serializer=None, response_deserializer=unpack)
        self.calls.append(call(nothing(), timeout=30, metadata=fabric.signer.metadata(ROLLOUTS)))
        return self.calls[-1]


@pytest.fixture
def learner_server():
    """learner_server(idle_s) -> (server, inbox, digest): a learner's server with exactly as many
    threads as its inbox needs (4 streams + the reserve), its inbox, and a weight server holding
    version 0 (of that digest)."""
    made = []

    def make(idle_s: float):
        limits = StreamLimits(per_peer=2, total=4, idle_s=idle_s)
        server = GrpcPeerServer("127.0.0.1", 0, RUN, workers=limits.total + RESERVE_WORKERS, signing_key=RSAPrivateKey())
        inbox = GrpcRolloutInbox(server, vocab_size=VOCAB, streams=limits)
        inbox.learner_version = 3
        store = VersionStore()
        digest = store.add(0, small_state())
        made.append((server, inbox, GrpcWeightServer(server, store)))
        return server, inbox, digest

    yield make
    for server, inbox, weights in made:
        weights.close()
        inbox.close()
        server.stop()


def test_idle_streams_past_the_limits_starve_nobody_and_are_cut(swarm, learner_server):
    server, inbox, digest = learner_server(idle_s=1.5)
    attackers, honest = [swarm() for _ in range(3)], swarm()
    idle = IdleStreams()
    try:
        calls = [idle.open(a, server.address) for a in attackers for _ in range(2)]  # 6 streams, 2 per key; 4 allowed
        assert wait_until(lambda: sum(c.done() for c in calls) == 2, 5, every=0.02)  # two refused at once ...
        refused = [c for c in calls if c.done()]
        assert all(c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "4 rollout streams open" in c.details() for c in refused)
        # ... four held open: a weight fetch is still served (the pool keeps a reserve) ...
        receiver = VersionStore()
        result = honest.weight_client(timeout_s=10).fetch(server.address, 0, digest, receiver)
        assert result.version == 0 and receiver.hashes[0] == digest
        # ... an honest sampler is told to come back, at once and with the reason, not left hanging ...
        started = time.time()
        acks = honest.rollout_sender(timeout_s=10).send(server.address, [group("early")])
        assert not acks[0]["ok"] and "try again later" in acks[0]["reason"] and time.time() - started < 2
        # ... and once the idle streams are cut (idle_s = 1.5 s), it is served
        assert wait_until(lambda: all(c.done() for c in calls), 5, every=0.02)
        assert [c.code() for c in calls if c not in refused] == [grpc.StatusCode.CANCELLED] * 4
        assert inbox.stats.reasons["slow sender"] == 4
        assert honest.rollout_sender(timeout_s=10).send(server.address, [group("later")]) == [{"ok": True}]
        assert inbox.get(timeout=5).problem_id == "later"
    finally:
        idle.release.set()


def test_cut_streams_give_their_server_threads_back(swarm, learner_server):
    """More idle streams over time than the server has threads: were a cut one to keep its thread,
    the pool (4 streams + the reserve) would run dry and the last rounds and the fetch would hang."""
    server, inbox, digest = learner_server(idle_s=0.3)
    attackers = [swarm() for _ in range(2)]
    idle = IdleStreams()
    rounds = server.workers // inbox.streams.total + 2
    try:
        for _ in range(rounds):
            calls = [idle.open(a, server.address) for a in attackers for _ in range(2)]
            assert wait_until(lambda: all(c.done() for c in calls), inbox.streams.idle_s + 5, every=0.02)
            assert [c.code() for c in calls] == [grpc.StatusCode.CANCELLED] * 4
        assert inbox.stats.reasons["slow sender"] == 4 * rounds > server.workers
        receiver = VersionStore()
        assert attackers[0].weight_client(timeout_s=10).fetch(server.address, 0, digest, receiver).version == 0
    finally:
        idle.release.set()


def bogus(*messages):
    """A holder's weight handler that answers every request with `messages` (and notes the requests)."""
    def handle(request, who="", peer=""):
        handle.requests.append(request)
        return iter(messages)

    handle.requests = []
    return handle


HOSTILE_HOLDERS = {
    # a snapshot is one payload: anything more is refused before a byte of it is read
    "too many payloads": (bogus(pack({"ok": True, "sizes": [1] * (MAX_HELD_VERSIONS + 1)})), CorruptVersion,
                          rf"announced {MAX_HELD_VERSIONS + 1} payloads for None -> 0 \(1..1\)"),
    "a payload over the receiver's limit": (bogus(pack({"ok": True, "sizes": [4 * 10**6]})), OversizedPayload, "limit"),
    "a size that is not a number": (bogus(pack({"ok": True, "sizes": ["10"]})), OversizedPayload, "limit"),
    "an oversized chunk": (bogus(pack({"ok": True, "sizes": [8000]}), bytes(CHUNK_BYTES + 1)), CorruptVersion,
                           f"chunks are 1..{CHUNK_BYTES} bytes"),
    "a chunk past the payload's end": (bogus(pack({"ok": True, "sizes": [10]}), bytes(6), bytes(6)), CorruptVersion,
                                       "a chunk of 6 bytes at byte 6 of a 10-byte payload"),
    "an empty chunk": (bogus(pack({"ok": True, "sizes": [10]}), b""), CorruptVersion, "a chunk of 0 bytes"),
    "a short transfer": (bogus(pack({"ok": True, "sizes": [10]}), bytes(4)), CorruptVersion, "6 bytes short"),
    "an oversized header": (bogus(bytes(HEADER_LIMIT + 1)), CorruptVersion, "a header of"),
    "no header": (bogus(), CorruptVersion, "no header"),
}


@pytest.mark.parametrize("kind", list(HOSTILE_HOLDERS))
def test_a_hostile_holder_is_refused_and_the_next_one_asked(swarm, kind):
    handler, error, reason = HOSTILE_HOLDERS[kind]
    learner, liar, receiver = swarm(), swarm(), swarm()
    state = small_state()
    store = VersionStore()
    digest = store.add(0, state)
    served = learner.weight_server(store)
    liar.server.weight_handler = handler
    client = receiver.weight_client(timeout_s=10, max_payload_bytes=payload_limit(state))
    assert client.max_payload_bytes < 4 * 10**6
    try:
        got = VersionStore()
        with pytest.raises(error, match=reason):
            client.fetch(liar.peer_id, 0, digest, got)
        assert handler.requests and handler.requests[-1]["want"] == 0  # the liar was asked (signed), and answered
        assert got.latest is None
        result = fetch_from_holders(client, [liar.peer_id, learner.peer_id], 0, digest, got, receiver.unreachable_errors())
        assert result.holder == learner.peer_id and got.hashes[0] == digest
    finally:
        served.close()


def test_a_message_over_the_clients_limit_is_refused_by_grpc(swarm):
    holder, receiver = swarm(), swarm()
    holder.server.weight_handler = bogus(pack({"ok": True, "sizes": [8 * 1024 * 1024]}), bytes(6 * 1024 * 1024))
    with pytest.raises(grpc.RpcError) as refused:  # the follower counts it as a failed holder, like any
        receiver.weight_client(timeout_s=10).fetch(holder.peer_id, 0, "0" * 64, VersionStore())
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_an_inbox_cannot_allow_more_streams_than_the_server_has_threads_for(swarm):
    learner = swarm()
    with pytest.raises(ValueError, match="leaves fewer than 16 of the server's 64 threads"):
        learner.rollout_inbox(vocab_size=VOCAB, streams=StreamLimits(total=60))


def test_peer_ids_name_the_key_and_the_address(swarm):
    peer = swarm()
    key, _, address = peer.peer_id.partition("@")
    assert key == peer.key_id and len(key) == 16 and address == peer.server.address
    assert peer.key_id != swarm().key_id  # each peer its own key


def test_a_receiver_that_stops_reading_weights_is_cut_off(swarm):
    holder, receiver = swarm(), swarm()
    holder.server.weight_send_s = 0.3
    sent, ended = [], threading.Event()

    def endless(request, who="", peer=""):  # a 400 MiB transfer, one 4 MiB chunk at a time
        try:
            yield pack({"ok": True, "sizes": [100 * CHUNK_BYTES]})
            chunk = bytes(CHUNK_BYTES)
            for _ in range(100):
                sent.append(len(chunk))
                yield chunk
        finally:
            ended.set()

    holder.server.weight_handler = endless
    body = pack({"have": None, "want": 0})
    messages = receiver.channels.get(holder.peer_id).stream_stream(WEIGHTS, request_serializer=None, response_deserializer=None)(
        iter([body]), timeout=30, metadata=receiver.signer.metadata(WEIGHTS, body))
    try:
        assert unpack(next(messages))["sizes"] == [100 * CHUNK_BYTES]  # then it reads no more
        assert ended.wait(10)  # the holder's transfer was cut, its thread freed ...
        assert len(sent) < 100  # ... long before the end
        with pytest.raises(grpc.RpcError) as cut:
            for _ in messages:  # what was on its way, then the cut
                pass
        assert cut.value.code() == grpc.StatusCode.CANCELLED
    finally:
        messages.cancel()
