"""Starving gRPC servers (issue 45, point 10), with real gRPC servers on loopback and attacking
clients built from the project's own code:
(a) one RSA key spelt many ways is one owner: its spellings share one key's stream share, a peer
    id naming a spelling's hash is refused, and a stream that only trickles is closed;
(b) calls that send nothing never hold a thread unsigned (refused while gRPC looks the method up),
    signed ones are bounded per key and cut after the request wait, and the server's queue is
    bounded (RESOURCE_EXHAUSTED past it), while an honest peer still gets through;
(c) one key takes part in at most max_runs_per_owner runs of a registry, however it spells itself,
    and runs waiting for their learner take no slot from a learner, whose samplers find it."""

import hashlib
import threading
import time
from dataclasses import dataclass

import grpc
import pytest
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.waiting import wait_until
from swarm.config.learner_keys import owner_form
from swarm.fabric.grpc.common import SERVICE, RequestSigner, key_id, pack, peer_id_of, unpack
from swarm.fabric.grpc.fabric import GrpcFabric
from swarm.fabric.grpc.registry import Registry
from swarm.fabric.grpc.server import RESERVE_WORKERS, ROLLOUTS, GrpcPeerServer
from swarm.fabric.grpc.rollouts import GrpcRolloutInbox
from swarm.fabric.local import LocalFabrics
from swarm.fabric.membership.records import Heartbeat
from swarm.fabric.rollouts.bans import PeerBans
from swarm.fabric.rollouts.inbox import StreamLimits
from swarm.fabric.signing import canonical_owner, owner_id, owner_key
from swarm.fabric.weights.announcements import newest_authorised
from tests.fabric.grpc.test_grpc_hostile import VOCAB, group
from tests.fabric.grpc.test_registry import Client, announcement, served  # noqa: F401  (served: a fixture)

RUN = "grpc-starvation-test"


@dataclass(frozen=True)
class SpeltSigner(RequestSigner):
    """An attacker's signer: its key's `[owner:...]` text with a trailing `spelling` (an OpenSSH key
    line takes a comment), each spelling a key id of its own when ids hashed the text."""

    spelling: bytes = b""

    @property
    def owner(self) -> bytes:
        return owner_form(self.key.get_public_key().to_bytes() + self.spelling)


def spellings(key, n: int) -> list[bytes]:
    return [b" spelling-%d" % i for i in range(n)]


def test_a_keys_spellings_are_one_owner():
    key = RSAPrivateKey()
    spelt = [owner_form(key.get_public_key().to_bytes() + s) for s in spellings(key, 12)]
    assert len(set(spelt)) == 12 and {owner_id(s) for s in spelt} == {key_id(owner_key(key))}
    assert {canonical_owner(s) for s in spelt} == {owner_key(key)}
    # a key made from the same modulus with another exponent is refused, not a new owner
    from cryptography.hazmat.primitives.asymmetric import rsa
    from hivemind.utils.crypto import RSAPublicKey

    numbers = key._private_key.public_key().public_numbers()
    other = RSAPublicKey(rsa.RSAPublicNumbers(3, numbers.n).public_key())
    with pytest.raises(ValueError, match="exponent 3"):
        owner_id(owner_form(other.to_bytes()))


@pytest.fixture
def learner():
    """learner(limits) -> (server, inbox): a learner's TLS server (as many threads as its inbox needs)."""
    made = []

    def make(limits: StreamLimits):
        server = GrpcPeerServer("127.0.0.1", 0, RUN, workers=limits.total + RESERVE_WORKERS, signing_key=RSAPrivateKey())
        inbox = GrpcRolloutInbox(server, vocab_size=VOCAB, streams=limits, bans=PeerBans(strikes=1000))
        inbox.learner_version = 3
        made.append((server, inbox))
        return server, inbox

    yield make
    for server, inbox in made:
        inbox.close()
        server.stop()


@pytest.fixture
def peers():
    with LocalFabrics("grpc", RUN) as fabrics:
        def make():
            return fabrics.make()

        make.registry = fabrics.bootstrap
        yield make


class Streams:
    """Rollout streams an attacker opens and keeps open: each sends `frames` (bytes), one every
    `every_s` seconds, then waits until released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def open(self, fabric, target: str, signer: RequestSigner, frames=(), every_s: float = 0.0, timeout_s: float = 30):
        def trickle():
            for frame in frames:
                if self.release.wait(every_s):
                    return
                yield frame
            self.release.wait(timeout_s)

        stub = fabric.channels.get(target).stream_stream(ROLLOUTS, request_serializer=None, response_deserializer=unpack)
        call = stub(trickle(), timeout=timeout_s, metadata=signer.metadata(ROLLOUTS))
        if frames:  # read the acks (a call's status comes after its last message is read)
            threading.Thread(target=_drain, args=(call,), daemon=True).start()
        return call


def _drain(call) -> None:
    try:
        for _ in call:
            pass
    except grpc.RpcError:
        pass


def test_twelve_spellings_of_one_key_hold_one_keys_share_of_streams(peers, learner):
    server, inbox = learner(StreamLimits(per_peer=4, total=48, idle_s=20))
    attacker, honest = peers(), peers()
    target = peer_id_of(server.key_id, server.address)
    streams = Streams()
    try:
        calls = [streams.open(attacker, target, SpeltSigner(attacker.signing_key, RUN, attacker.peer_id, spelling=s))
                 for s in spellings(attacker.signing_key, 12)]
        # 12 spellings, one key: 4 streams held (per_peer), the other 8 refused at once
        assert wait_until(lambda: sum(c.done() for c in calls) == 8, 10, every=0.02)
        assert all(c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for c in calls if c.done())
        assert inbox.open_streams() == 4
        # an id made from a spelling's hash (as ids were) is not the key's id: refused
        old_id = hashlib.sha256(SpeltSigner(attacker.signing_key, RUN, "", spelling=b" x").owner).hexdigest()[:16]
        forged = SpeltSigner(attacker.signing_key, RUN, peer_id_of(old_id, "127.0.0.1:1"), spelling=b" x")
        with pytest.raises(grpc.RpcError) as refused:
            list(streams.open(attacker, target, forged, timeout_s=5))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED and "not the signing key's" in refused.value.details()
        # and an honest sampler's groups go straight in
        started = time.monotonic()
        assert honest.rollout_sender(timeout_s=10).send(target, [group("honest")]) == [{"ok": True}]
        assert inbox.get(timeout=5).problem_id == "honest" and time.monotonic() - started < 5
    finally:
        streams.release.set()


def test_a_stream_that_only_trickles_is_closed(peers, learner):
    limits = StreamLimits(per_peer=1, total=1, idle_s=20, rate_grace_s=1.0, stream_bytes_per_s=1024)
    server, inbox = learner(limits)
    attacker, honest = peers(), peers()
    target = peer_id_of(server.key_id, server.address)
    streams = Streams()
    try:
        # the one stream slot, held by a tiny frame every 0.3 s (each within idle_s, together far under 1 KiB/s)
        started = time.monotonic()
        call = streams.open(attacker, target, attacker.signer, frames=[b"x" * 8] * 100, every_s=0.3)
        assert wait_until(lambda: inbox.open_streams() == 1, 5, every=0.02)
        refused = honest.rollout_sender(timeout_s=10).send(target, [group("early")])
        assert not refused[0]["ok"] and "try again later" in refused[0]["reason"]
        # closed once its grace has passed: within the grace and a tick, not after idle_s
        assert wait_until(call.done, limits.rate_grace_s + 3, every=0.02)
        assert call.code() == grpc.StatusCode.CANCELLED and time.monotonic() - started < limits.idle_s / 2
        assert inbox.stats.reasons["slow sender"] == 1
        assert honest.rollout_sender(timeout_s=10).send(target, [group("later")]) == [{"ok": True}]
        assert inbox.get(timeout=5).problem_id == "later"
    finally:
        streams.release.set()


def idle_calls(channel, path: str, metadata_of, n: int, release: threading.Event, unary: bool):
    """`n` calls to `path` that send nothing until released; metadata_of(i) gives each one's metadata."""
    def nothing():
        release.wait(30)
        return
        yield

    calls = []
    for i in range(n):
        if unary:
            stub = channel.stream_unary(path, request_serializer=None, response_deserializer=unpack)
        else:
            stub = channel.stream_stream(path, request_serializer=None, response_deserializer=unpack)
        calls.append(stub.future(nothing(), timeout=30, metadata=metadata_of(i)) if unary
                     else stub(nothing(), timeout=30, metadata=metadata_of(i)))
    return calls


def test_calls_that_send_nothing_hold_no_thread_unsigned_and_a_bounded_one_signed(peers):
    learner, attacker, honest = peers(), peers(), peers()
    inbox = learner.rollout_inbox(vocab_size=VOCAB)
    inbox.learner_version = 3
    registry = peers.registry.addresses()[0]
    versions = f"/{SERVICE}.Registry/Versions"
    release = threading.Event()
    try:
        # 512 unsigned calls that send nothing, 256 at the registry and 256 at the learner ...
        started = time.monotonic()
        unsigned = (idle_calls(attacker.channels.get(registry), versions, lambda i: (), 256, release, unary=True)
                    + idle_calls(attacker.channels.get(learner.peer_id), ROLLOUTS, lambda i: (), 256, release, unary=False))
        # ... are all refused at once (unauthenticated, or past the server's bounded queue), none left waiting
        assert wait_until(lambda: all(c.done() for c in unsigned), 15, every=0.05)
        codes = {c.code() for c in unsigned}
        assert codes <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        assert time.monotonic() - started < 15
        # signed calls that send nothing: one key holds at most REGISTRY_CALLS_PER_OWNER (8), the rest refused at once
        signed = idle_calls(attacker.channels.get(registry), versions,
                            lambda i: attacker.signer.metadata(versions, b"x%d" % i), 20, release, unary=True)
        assert wait_until(lambda: sum(c.done() for c in signed) >= 12, 5, every=0.02)
        refused = [c for c in signed if c.done()]
        assert all(c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "holds 8 calls open" in c.details() for c in refused)
        # meanwhile an honest Versions call at the registry and an honest group at the learner are served
        started = time.monotonic()
        assert honest.latest_announced([learner.public_key]) is None
        assert honest.rollout_sender(timeout_s=10).send(learner.peer_id, [group("honest")]) == [{"ok": True}]
        assert inbox.get(timeout=5).problem_id == "honest" and time.monotonic() - started < 5
        # and the 8 held are cut after the request wait (3 s), not left for 10 s or forever
        assert wait_until(lambda: all(c.done() for c in signed), 6, every=0.05)
        assert {c.code() for c in signed if c not in refused} == {grpc.StatusCode.CANCELLED}
    finally:
        release.set()
        inbox.close()


def test_a_servers_queue_is_bounded_and_an_honest_call_gets_through_within_the_request_wait(served):  # noqa: F811
    from swarm.fabric.grpc.common import REQUEST_WAIT_S

    address = served(Registry(), workers=4)  # 4 threads, a queue of 2: at most 6 calls at once
    path = f"/{SERVICE}.Registry/Versions"
    release = threading.Event()
    attackers = [Client(address) for _ in range(10)]  # ten keys, one idle call each
    try:
        calls = [idle_calls(a.channel, path, lambda i, a=a: RequestSigner(a.key, RUN, a.peer).metadata(path, b"x"), 1,
                            release, unary=True)[0] for a in attackers]
        assert wait_until(lambda: sum(c.done() for c in calls) >= 4, 5, every=0.02)
        assert all(c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for c in calls if c.done())
        # an honest call may be turned away while the queue is full, never for longer than the request wait
        honest, started, reply = Client(address), time.monotonic(), None
        while reply is None and time.monotonic() - started < REQUEST_WAIT_S + 5:
            try:
                reply = honest.call("Versions", {"run_id": honest.run_id})
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                time.sleep(0.2)
        assert reply == {"versions": []} and time.monotonic() - started < REQUEST_WAIT_S + 5
        honest.close()
    finally:
        release.set()
        for a in attackers:
            a.close()


def test_one_key_takes_at_most_its_share_of_runs_and_a_new_run_is_found(served):  # noqa: F811
    address = served(Registry(max_runs=16, max_runs_per_owner=2))
    key = RSAPrivateKey()
    taken = []
    for i in range(15):  # one key, fifteen runs, each under another spelling of the key
        client = Client(address, key, run_id=f"squat-{i}")
        client_signer = SpeltSigner(key, f"squat-{i}", client.peer, spelling=b" run-%d" % i)
        path = f"/{SERVICE}.Registry/Announce"
        body = pack({"run_id": f"squat-{i}", **announcement(key, f"squat-{i}", 1), "expiry_s": 600.0})
        reply = client.channel.stream_unary(path, request_serializer=None, response_deserializer=unpack)(
            iter([body]), timeout=10, metadata=client_signer.metadata(path, body))
        taken.append(reply["ok"] and client.heartbeat(expiry_s=600.0)["ok"])
        if not reply["ok"]:
            assert "max_runs_per_owner: 2" in reply["reason"], reply
        client.close()
    assert taken == [True, True] + [False] * 13
    # samplers of runs no learner holds yet (throwaway keys) wait apart: they take no learner's slot
    for i in range(16):
        waiting = Client(address, run_id=f"waiting-{i}")
        record = Heartbeat(role="sampler").record(waiting.peer, time.time()).dict()
        reply = waiting.call("Heartbeat", {"run_id": f"waiting-{i}", "record": record, "expiry_s": 600.0})
        waiting.close()
        assert reply["ok"], reply
    # a seventeenth waiting run is one too many (its sampler is told to start the learner first) ...
    late = Client(address, run_id="waiting-16")
    record = Heartbeat(role="sampler").record(late.peer, time.time()).dict()
    reply = late.call("Heartbeat", {"run_id": "waiting-16", "record": record, "expiry_s": 600.0})
    late.close()
    assert not reply["ok"] and "wait for their learner" in reply["reason"]
    # a new run: its learner gets in, and its sampler finds its announcement
    learner = Client(address, run_id="honest-run")
    assert learner.heartbeat()["ok"] and learner.announce(7)["ok"]
    sampler = GrpcFabric(address, "honest-run", RSAPrivateKey(), serve=False, heartbeat_s=1.0)
    try:
        found = sampler.latest_announced([learner.owner])
        assert found is not None and found.version == 7
        listed = sampler._call("Versions", {"run_id": "honest-run", "owners": [learner.owner]})["versions"]
        assert newest_authorised([(i["owner"], unpack(i["payload"])) for i in listed], [learner.owner], "honest-run").version == 7
    finally:
        sampler.shutdown()
        learner.close()
