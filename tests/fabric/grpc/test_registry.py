"""The gRPC registry (swarm bootstrap --transport grpc) against a hostile peer, over real gRPC on
loopback: every call is signed and every record belongs to the key that signed it, so a squatter
cannot take the learner's record and two peers claiming one address are two records; quotas per IP,
per run and on runs refuse with the limit named; Members replies come in pages; a signed
announcement of another run is refused (and ignored by samplers), a NaN or infinite expiry is
refused, and announcements under throwaway keys cannot swell a sampler's reply."""

import math
import threading
import time

import grpc
import pytest
from hivemind.utils.crypto import RSAPrivateKey

from swarm.fabric.grpc.common import REGISTRY_REQUEST_LIMIT, SERVICE, Caller, RequestSigner, key_id, pack, peer_id_of, unpack
from swarm.fabric.signing import owner_key
from swarm.fabric.grpc.fabric import GrpcFabric
from swarm.fabric.grpc.server import Channels
from swarm.fabric.grpc.registry import PAGE_SIZE, Registry, serve_registry, stop_registry
from swarm.fabric.membership.records import Heartbeat
from swarm.fabric.weights.announcements import RunSampling, VersionAnnouncement
from swarm.fabric.weights.announcements import newest_authorised

RUN = "registry-test"


class Client:
    """A peer's signed calls to a registry, claiming whatever peer id it is given (as a hostile
    peer's own client would)."""

    def __init__(self, address: str, key=None, *, run_id: str = RUN, address_claimed: str = "127.0.0.1:40000") -> None:
        self.key = key or RSAPrivateKey()
        self.owner, self.run_id = owner_key(self.key), run_id
        self.peer = peer_id_of(key_id(self.owner), address_claimed)
        self.channels = Channels()
        self.channel = self.channels.get(address)  # TLS, the registry's certificate pinned by the key id in its address

    def call(self, method: str, request: dict, *, claim: str | None = None) -> dict:
        path, body = f"/{SERVICE}.Registry/{method}", pack(request)
        metadata = RequestSigner(self.key, self.run_id, claim or self.peer).metadata(path, body)
        return self.channel.stream_unary(path, request_serializer=None, response_deserializer=unpack)(
            iter([body]), timeout=10, metadata=metadata)

    def heartbeat(self, *, record_peer: str | None = None, claim: str | None = None, expiry_s=30.0, version: int = 0) -> dict:
        record = Heartbeat(role="learner", version=version).record(record_peer or claim or self.peer, time.time()).dict()
        return self.call("Heartbeat", {"run_id": self.run_id, "record": record, "expiry_s": expiry_s}, claim=claim)

    def announce(self, version: int, *, run_id: str | None = None, expiry_s=60.0) -> dict:
        return self.call("Announce", {"run_id": self.run_id, **announcement(self.key, run_id or self.run_id, version),
                                      "expiry_s": expiry_s})

    def close(self) -> None:
        self.channels.close()


def announcement(key, run_id: str, version: int) -> dict:
    payload = pack(VersionAnnouncement.of(run_id, version, "a" * 64, "k@127.0.0.1:1", 0.0, RunSampling()).dict())
    return {"owner": owner_key(key), "payload": payload, "signature": key.sign(payload)}


@pytest.fixture
def served():
    """served(registry) -> its address; every server and client made is closed after the test."""
    servers, clients = [], []

    def serve(registry: Registry | None = None, **options) -> str:
        key = RSAPrivateKey()
        server, port = serve_registry(registry or Registry(), "127.0.0.1", 0, signing_key=key, **options)
        servers.append(server)
        return f"{key_id(owner_key(key))}@127.0.0.1:{port}"

    def client(address: str, **options) -> Client:
        made = Client(address, **options)
        clients.append(made)
        return made

    serve.client = client
    yield serve
    for made in clients:
        made.close()
    for server in servers:
        stop_registry(server)


def observer(address: str) -> GrpcFabric:
    return GrpcFabric(address, RUN, RSAPrivateKey(), serve=False, heartbeat_s=1.0)


def test_an_announcement_of_another_run_is_refused_and_ignored(served):
    learner = served.client(served())
    replay = {"run_id": RUN, **announcement(learner.key, "run-a", 40), "expiry_s": 60.0}  # run A's, sent into this run
    reply = learner.call("Announce", replay)
    assert not reply["ok"] and f"is for run 'run-a', not '{RUN}'" in reply["reason"]
    assert learner.announce(3)["ok"]  # this run's own, older number, still welcome
    # and a sampler ignores another run's announcement even if some registry passed it on
    items = [(learner.owner, VersionAnnouncement.of("run-a", 40, "a" * 64, "x", 0.0, RunSampling()).dict())]
    assert newest_authorised(items, [learner.owner], RUN) is None


def test_an_announcement_is_posted_only_by_its_own_key(served):
    address = served()
    learner, other = served.client(address), served.client(address)
    # the learner's genuine signed announcement, re-posted by another peer (to keep it alive after it expired, say)
    reply = other.call("Announce", {"run_id": RUN, **announcement(learner.key, RUN, 5), "expiry_s": 60.0})
    assert not reply["ok"] and "posted by the key that signed it" in reply["reason"]
    assert other.call("Versions", {"run_id": RUN})["versions"] == []


@pytest.mark.parametrize("expiry", [math.nan, math.inf, -1.0, 0.0, "soon"])
def test_records_and_announcements_need_a_finite_positive_expiry(served, expiry):
    peer = served.client(served())
    reply = peer.announce(1, expiry_s=expiry)
    assert not reply["ok"] and "expiry" in reply["reason"]
    reply = peer.heartbeat(expiry_s=expiry)
    assert not reply["ok"] and "expiry" in reply["reason"]
    assert peer.call("Members", {"run_id": RUN})["members"] == []


def test_throwaway_keys_cannot_swell_a_samplers_reply(served):
    address = served()
    learner = served.client(address)
    assert learner.announce(7)["ok"]
    for _ in range(40):
        assert served.client(address).announce(99)["ok"]
    everything = learner.call("Versions", {"run_id": RUN})["versions"]
    asked = learner.call("Versions", {"run_id": RUN, "owners": [learner.owner]})["versions"]
    assert len(everything) == 41 and [v["owner"] for v in asked] == [learner.owner]


def test_a_squatter_cannot_take_the_learners_record_and_peers_sharing_an_address_are_two_records(served):
    address = served()
    learner, squatter = served.client(address), served.client(address)
    assert learner.heartbeat(version=5)["ok"]
    # claiming the learner's peer id: its key id is not the squatter's, so the call is not authenticated
    with pytest.raises(grpc.RpcError) as refused:
        squatter.heartbeat(claim=learner.peer, version=99)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED and "not the signing key's" in refused.value.details()
    # signed as itself, carrying a record with the learner's id
    reply = squatter.heartbeat(record_peer=learner.peer, version=99)
    assert not reply["ok"] and "must carry its own peer's id" in reply["reason"]
    # the learner's address under its own key id: a record of its own, beside the learner's
    assert squatter.heartbeat(version=99)["ok"]
    # two volunteers behind different NATs with the same private address: two records
    volunteers = [served.client(address, address_claimed="10.0.0.7:40001") for _ in range(2)]
    assert all(v.heartbeat()["ok"] for v in volunteers)
    assert learner.heartbeat(version=6)["ok"]  # and the learner still replaces its own record

    watcher = observer(address)
    try:
        members = {m.owner: m for m in watcher.members()}
    finally:
        watcher.shutdown()
    assert set(members) == {learner.owner, squatter.owner, volunteers[0].owner, volunteers[1].owner}
    assert members[learner.owner].record.version == 6 and members[learner.owner].record.peer_id == learner.peer
    assert members[squatter.owner].record.peer_id.endswith("@127.0.0.1:40000") and members[squatter.owner].record.peer_id != learner.peer
    assert {members[v.owner].record.peer_id.split("@")[1] for v in volunteers} == {"10.0.0.7:40001"}


def test_quotas_refuse_with_the_limit_named(served):
    per_ip = served(Registry(max_per_ip=3))  # every test client comes from 127.0.0.1
    peers = [served.client(per_ip) for _ in range(4)]
    assert [p.heartbeat()["ok"] for p in peers[:3]] == [True] * 3
    reply = peers[3].heartbeat()
    assert not reply["ok"] and "max_per_ip" in reply["reason"] and "127.0.0.1 holds 3 records" in reply["reason"]
    assert peers[0].heartbeat(version=1)["ok"]  # replacing one's own record takes no more room
    assert [p.announce(1)["ok"] for p in peers[:3]] == [True] * 3  # announcements have their own quota
    reply = peers[3].announce(1)
    assert not reply["ok"] and "max_per_ip" in reply["reason"]

    per_run = served(Registry(max_per_run=2))
    peers = [served.client(per_run) for _ in range(3)]
    assert [p.heartbeat()["ok"] for p in peers[:2]] == [True, True]
    reply = peers[2].heartbeat()
    assert not reply["ok"] and "max_per_run" in reply["reason"] and f"run '{RUN}' holds 2 records" in reply["reason"]

    runs = served(Registry(max_runs=2))
    replies = [served.client(runs, run_id=f"run-{i}").heartbeat() for i in range(3)]
    assert [r["ok"] for r in replies] == [True, True, False] and "max_runs" in replies[2]["reason"]

    expiring = served(Registry(max_per_ip=1))
    first, second = served.client(expiring), served.client(expiring)
    assert first.heartbeat(expiry_s=0.3)["ok"]
    assert not second.heartbeat()["ok"]
    time.sleep(0.5)  # an expired record holds no room
    assert second.heartbeat()["ok"]


def test_members_come_in_pages_and_a_listing_follows_a_bounded_number(served):
    address = served(Registry(page_size=3))
    peers = [served.client(address, address_claimed=f"127.0.0.1:{40000 + i}") for i in range(8)]
    assert all(p.heartbeat()["ok"] for p in peers)
    first = peers[0].call("Members", {"run_id": RUN})
    assert len(first["members"]) == 3 and isinstance(first["next"], str)
    second = peers[0].call("Members", {"run_id": RUN, "after": first["next"]})
    assert len(second["members"]) == 3 and not {m["owner"] for m in first["members"]} & {m["owner"] for m in second["members"]}
    watcher = observer(address)
    try:
        assert {m.owner for m in watcher.members()} == {p.owner for p in peers}  # 3 pages followed
        watcher.member_pages = 2
        assert len(watcher.members()) == 6  # no further than it is allowed to read
    finally:
        watcher.shutdown()


def test_a_full_page_of_the_largest_records_stays_under_the_message_limit():
    registry = Registry()
    for i in range(PAGE_SIZE + 5):
        owner = b"[owner:" + bytes([i % 256]) * 1016 + b"]"  # as large as a request may carry (MAX_OWNER_BYTES)
        peer = peer_id_of(f"{i:016x}", "h" * 100)[:128]
        record = dict(role="sampler", peer_id=peer, model="m" * 256, model_hash="f" * 128, version=2**62, rollouts=2**62,
                      tokens_per_s=1e300, software="s" * 32, time=1e300)
        caller = Caller(owner=owner, key=f"{i:016x}", peer=peer, run_id=RUN, ip=f"10.0.{i // 200}.{i % 200}")
        assert registry.heartbeat({"run_id": RUN, "record": record, "expiry_s": 60.0}, caller)["ok"]
    page = registry.list_members({"run_id": RUN})
    assert len(page["members"]) == PAGE_SIZE and page["next"] is not None
    assert len(pack(page)) < REGISTRY_REQUEST_LIMIT


def test_a_caller_that_never_sends_its_request_is_cut_off(served):
    address = served(request_wait_s=0.5)
    peer = served.client(address)
    never = threading.Event()

    def nothing():
        never.wait(20)
        yield b""

    path = f"/{SERVICE}.Registry/Members"
    started = time.time()
    with pytest.raises(grpc.RpcError) as cut:
        peer.channel.stream_unary(path, request_serializer=None, response_deserializer=unpack)(
            nothing(), timeout=15, metadata=RequestSigner(peer.key, RUN, peer.peer).metadata(path, b""))
    never.set()
    assert cut.value.code() == grpc.StatusCode.CANCELLED and time.time() - started < 5
    assert peer.heartbeat()["ok"]  # and the registry serves on
