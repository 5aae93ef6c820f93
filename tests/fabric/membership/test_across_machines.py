"""What a peer needs to work across machines, checked on loopback: announced addresses, the order
addresses are offered in, a registry that cannot share its port, heartbeats on their own schedule,
a delta chain only where it is smaller than a snapshot, upload slots, and a sampler that says why
no version came. (tests/test_wan*.py run the same across network namespaces.)"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from swarm.config import LearnerConfig, SamplerConfig, check_announce_addr
from swarm.fabric.membership.addresses import order_for_others
from swarm.fabric.membership.pulse import Pulse
from swarm.fabric.transports import start_bootstrap
from swarm.fabric.weights.upload_slots import UploadSlots
from swarm.fabric.weights.versions import VersionStore, snapshot_bytes

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ"


def test_peers_listen_on_every_interface_by_default_and_check_announced_addresses():
    assert LearnerConfig(peers=[PEER]).host == "0.0.0.0"
    assert check_announce_addr("grpc", "203.0.113.7:40000") == "203.0.113.7:40000"
    assert check_announce_addr("hivemind", "/ip4/203.0.113.7/tcp/31337")
    for bad, message in [("0.0.0.0", "wildcard"), ("example.org", "not an IP address"), ("1.2.3.4:99999", "1..65535"),
                         ("/ip4/1.2.3.4", "names no port")]:
        with pytest.raises(ValueError, match=message):
            check_announce_addr("hivemind", bad)
    with pytest.raises(ValueError, match="hivemind"):
        SamplerConfig(peers=["127.0.0.1:1"], transport="grpc", learner_keys=["W293bmVyOnNzaC1yc2EgQUFBQV0="], auto_relay=True)


def test_addresses_for_others_come_announced_then_public_then_private_then_loopback():
    maddrs = ["/ip4/127.0.0.1/tcp/1/p2p/Q", "/ip4/192.168.1.5/tcp/1/p2p/Q", "/ip4/8.8.4.4/tcp/1/p2p/Q"]
    assert order_for_others(maddrs) == [maddrs[2], maddrs[1], maddrs[0]]
    assert order_for_others(maddrs, ["/ip4/203.0.113.7/tcp/9/p2p/Q"])[0] == "/ip4/203.0.113.7/tcp/9/p2p/Q"


@pytest.mark.parametrize("transport", ["hivemind", "grpc"])
def test_a_bootstrap_offers_its_announced_address_first(transport):
    node = start_bootstrap(transport, run_id="announce", host="127.0.0.1", port=0, announce_addr="203.0.113.7:40999")
    try:
        first = node.addresses()[0]
        assert "203.0.113.7" in first and "40999" in first, node.addresses()
    finally:
        node.shutdown()


def test_a_second_grpc_registry_on_a_port_in_use_fails_to_start():
    first = start_bootstrap("grpc", run_id="port", host="127.0.0.1", port=0)
    try:
        port = int(first.addresses()[0].rsplit(":", 1)[1])
        with pytest.raises(OSError, match="in use"):
            start_bootstrap("grpc", run_id="port", host="127.0.0.1", port=port)
    finally:
        first.shutdown()


def test_a_pulse_beats_on_its_own_schedule_and_at_once_when_poked():
    times: list[float] = []
    failures = iter([RuntimeError("swarm unreachable")])

    def beat():
        times.append(time.monotonic())
        error = next(failures, None)
        if error:
            raise error  # a failed beat must not end the pulse

    def until(condition, timeout_s: float) -> bool:  # bounded: a loaded machine wakes threads late
        deadline = time.monotonic() + timeout_s
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.01)
        return condition()

    farewells: list[float] = []
    pulse = Pulse(beat, 0.2, farewell=lambda: farewells.append(time.monotonic()))
    try:
        assert until(lambda: len(times) >= 4, 10.0), times  # on its own, a failed beat notwithstanding
        gaps = [b - a for a, b in zip(times, times[1:4])]
        assert min(gaps) >= 0.15 and max(gaps) < 2.0, gaps  # on its schedule: no sooner, nor ten times later
    finally:
        pulse.close()
    assert pulse.failures == 1
    # poked: at once, not after its interval (30 s here, so that a late thread cannot pass for one)
    slow_times: list[float] = []
    slow = Pulse(lambda: slow_times.append(time.monotonic()), 30.0)
    try:
        assert until(lambda: len(slow_times) == 1, 10.0)
        slow.poke()
        assert until(lambda: len(slow_times) == 2, 10.0), slow_times
    finally:
        slow.close()
    # closed: the leaving record once, after the last beat (which would overwrite it), and never again
    pulse.close()
    assert len(farewells) == 1 and farewells[0] > times[-1]


def test_a_delta_chain_is_sent_only_when_smaller_than_a_snapshot():
    torch.manual_seed(0)
    store = VersionStore(capacity=16)
    state = {"w": torch.randn(4096)}
    store.add(0, state)
    for version in range(1, 6):
        state = {"w": state["w"] + torch.randn(4096)}  # every weight changes: each delta is about a snapshot
        store.add(version, state)
    chain = [store.deltas[v] for v in range(1, 6)]
    assert sum(map(len, chain)) > snapshot_bytes(store.states[5])
    sent = store.payloads(0, 5)
    assert len(sent) == 1 and sent[0][:1] == b"R"  # the snapshot
    assert store.payloads(4, 5) == [store.deltas[5]]  # one delta is smaller than the snapshot


def test_upload_slots_refuse_beyond_the_limit_and_free_on_release():
    slots = UploadSlots(2)
    assert slots.take() and slots.take() and not slots.take()
    slots.release()
    assert slots.take() and slots.refused == 1
    assert all(UploadSlots(None).take() for _ in range(100))


def _sampler_error(tmp_path, swarm, key: str, run_id: str = "why") -> str:
    done = subprocess.run([sys.executable, "-m", "swarm.cli", "sampler", "--peers", swarm.bootstrap_address, "--run-id", run_id,
                           "--learner-key", key, "--wait-s", "4", "--run-dir", str(tmp_path / "s"),
                           "--identity-dir", str(tmp_path / "keys")], capture_output=True, text=True, timeout=240)
    assert done.returncode != 0
    return done.stdout + done.stderr


def test_a_sampler_without_a_version_says_why(tmp_path):
    """No learner in the run; a learner under another key than the one given. The two samplers run
    at once, on one bootstrap: one in a run nobody learns in, one in the learner's run."""
    from concurrent.futures import ThreadPoolExecutor

    from swarm.cli.launcher import LocalSwarm
    from swarm.config.learner_keys import encode_learner_key
    from hivemind.utils.crypto import RSAPrivateKey
    from swarm.fabric.signing import owner_key

    stranger = encode_learner_key(owner_key(RSAPrivateKey()))
    swarm = LocalSwarm(tmp_path, run_id="why")
    try:
        swarm.bootstrap_address = swarm.start_bootstrap()
        swarm.start_learner(swarm.bootstrap_address, "--checkpoint-every", "0")
        with ThreadPoolExecutor(2) as pool:
            empty = pool.submit(_sampler_error, tmp_path / "a", swarm, stranger, "nobody-learns")
            other_key = pool.submit(_sampler_error, tmp_path / "b", swarm, stranger)
            assert "no learner has joined run 'nobody-learns'" in empty.result()
            assert "under other keys" in other_key.result()
    finally:
        swarm.stop_all()
