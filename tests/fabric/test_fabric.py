"""The swarm fabric on real localhost swarms: hivemind DHT nodes with their p2p daemons, the
bootstrap node as a real process, signed and schema-checked membership records."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.waiting import wait_until
from swarm.fabric.hivemind.dht import start_dht
from swarm.fabric.membership.identity import load_or_create_signing_key
from swarm.fabric.interface import JoinError
from swarm.fabric.membership.records import Heartbeat, members_key
from swarm.fabric.hivemind.records import MembershipPublisher, list_members
from swarm.runlog import read_jsonl

RUN = "test-run"


@pytest.fixture
def nodes():
    started = []

    def start(**kwargs):
        dht, validator = start_dht(RUN, **kwargs)
        started.append(dht)
        return dht, validator

    yield start
    for dht in started:
        dht.shutdown()


def maddrs(dht):
    return [str(m) for m in dht.get_visible_maddrs()]


def test_join_through_bootstrap_and_through_a_peer_then_records_expire(nodes, tmp_path):
    boot, _ = nodes()
    a, sign_a = nodes(initial_peers=maddrs(boot), signing_key=load_or_create_signing_key(tmp_path / "a.sign.key"))
    b, sign_b = nodes(initial_peers=maddrs(a))  # joins through a non-bootstrap peer
    pub_a = MembershipPublisher(a, RUN, sign_a.local_public_key, heartbeat_s=1.0, expiry_heartbeats=3)
    pub_b = MembershipPublisher(b, RUN, sign_b.local_public_key, heartbeat_s=1.0, expiry_heartbeats=3)
    assert pub_a.heartbeat(Heartbeat(role="sampler", model="embedded", version=3, rollouts=7, tokens_per_s=120.5))
    assert pub_b.heartbeat(Heartbeat(role="learner", model="embedded", version=5))

    def roles():
        return {(m.record.role, m.record.version, m.record.peer_id) for m in list_members(boot, RUN)}

    wait_until(lambda: roles() == {("sampler", 3, a.peer_id.to_base58()), ("learner", 5, b.peer_id.to_base58())}, 20,
               "both records listed", every=0.25)
    member = next(m for m in list_members(boot, RUN) if m.record.role == "sampler")
    assert member.record.rollouts == 7 and member.record.tokens_per_s == 120.5 and member.record.software

    # a stops heartbeating and leaves; b keeps going: within a few heartbeats only b is listed
    a.shutdown()
    deadline = time.time() + 15
    while time.time() < deadline and len(roles()) != 1:
        pub_b.heartbeat(Heartbeat(role="learner", model="embedded", version=6))
        time.sleep(1.0)
    assert roles() == {("learner", 6, b.peer_id.to_base58())}


def test_forged_and_malformed_records_are_refused(nodes):
    from hivemind.utils import get_dht_time

    boot, _ = nodes()
    honest, sign_h = nodes(initial_peers=maddrs(boot))
    attacker, sign_x = nodes(initial_peers=maddrs(boot))
    assert MembershipPublisher(honest, RUN, sign_h.local_public_key).heartbeat(Heartbeat(role="sampler", version=1))
    expiry = get_dht_time() + 30
    good = dict(role="learner", peer_id="x", model="", model_hash="", version=99, rollouts=0, tokens_per_s=0.0,
                software="0", time=float(get_dht_time()))
    # another peer's subkey: the signature cannot match the public key in the subkey
    assert not attacker.store(members_key(RUN, sign_x.local_public_key), subkey=sign_h.local_public_key, value=good, expiration_time=expiry)
    # its own subkey, but values that break the schema
    for bad in ({**good, "role": "boss"}, {**good, "version": 1.5}, {**good, "version": -1}, {"role": "learner"}):
        assert not attacker.store(members_key(RUN, sign_x.local_public_key), subkey=sign_x.local_public_key, value=bad, expiration_time=expiry)
    # a subkey without any owner key is refused by the schema too
    assert not attacker.store(members_key(RUN, sign_x.local_public_key), subkey=b"anyone", value=good, expiration_time=expiry)
    listed = list_members(boot, RUN)
    assert [(m.record.role, m.record.version) for m in listed] == [("sampler", 1)]


def test_unreachable_bootstrap_fails_fast_with_a_clear_error():
    started = time.time()
    with pytest.raises(JoinError, match="could not join the swarm through /ip4/127.0.0.1/tcp/9/p2p/"):
        start_dht(RUN, initial_peers=["/ip4/127.0.0.1/tcp/9/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ"])
    assert time.time() - started < 30
    with pytest.raises(ValueError, match="not a multiaddr"):
        start_dht(RUN, initial_peers=["127.0.0.1:31337"])


def start_bootstrap_process(identity, run_dir, port=0):
    """A `swarm bootstrap` process; its address comes from the ready.json it writes."""
    from swarm.runlog import wait_ready

    cmd = [sys.executable, "-m", "swarm.cli", "bootstrap", "--host", "127.0.0.1", "--port", str(port),
           "--identity", str(identity), "--run-id", RUN, "--status-every-s", "1", "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    ready = wait_ready(run_dir, timeout_s=60, alive=lambda: proc.poll() is None, pid=proc.pid)
    if ready is None:
        proc.kill()
        raise AssertionError("bootstrap node wrote no ready.json:\n" + proc.communicate()[0])
    return proc, ready["addresses"][0]


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_bootstrap_process_serves_joins_and_keeps_its_peer_id_across_restarts(nodes, tmp_path):
    identity = tmp_path / "boot.p2p.key"
    proc, addr = start_bootstrap_process(identity, tmp_path / "boot")
    try:
        peer_id = addr.rsplit("/p2p/", 1)[1]
        dht, validator = nodes(initial_peers=[addr])
        assert MembershipPublisher(dht, RUN, validator.local_public_key).heartbeat(Heartbeat(role="sampler", version=2))

        def counted():
            return [e for e in read_jsonl(tmp_path / "boot" / "events.jsonl") if e["event"] == "status" and e["samplers"] == 1]

        wait_until(counted, 20, "the member counted", every=0.25)  # its status record counts the member
    finally:
        stop(proc)
    assert proc.returncode == 0
    port = int(re.search(r"/tcp/(\d+)/", addr).group(1))
    proc2, addr2 = start_bootstrap_process(identity, tmp_path / "boot-again", port=port)
    try:
        assert addr2.rsplit("/p2p/", 1)[1] == peer_id
        assert addr2 == addr
    finally:
        stop(proc2)
