"""Relaying versions across machines (benchmarks/wan.py namespaces, tbf-shaped links): samplers
fetch from each other under the learner's upload budget; a holder killed mid-transfer or serving
a corrupt version is passed over for another, and the version that arrives is still bit-exact.

No delay emulation here (no netem): links are shaped in bandwidth only.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from benchmarks.wan import Wan, wan_unavailable
from benchmarks.wan_swarm import WanSwarm, wait_for
from tests.wan.test_wan import QUICK_SAMPLER, TRANSPORTS, fetched, start_run, steps_of

UNAVAILABLE = wan_unavailable(nat=False)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(UNAVAILABLE is not None, reason=f"WAN harness: {UNAVAILABLE}")]
SCRIPT = str(Path(__file__).parents[1] / "helpers" / "wan_weights.py")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_samplers_relay_versions_within_the_learners_upload_budget(tmp_path, transport):
    """A learner on an 8 Mbit/s link that serves one transfer at a time, three samplers: versions
    reach every sampler, some through another sampler, and the learner uploads fewer copies than
    the samplers fetch."""
    with Wan() as wan:
        a, b = wan.host("a"), wan.host("b", rate_mbit=8)
        hosts = [wan.host(f"s{i}", rate_mbit=50) for i in range(3)]
        swarm = WanSwarm(wan, tmp_path)
        try:
            addr, learner, key = start_run(swarm, a, b, transport, "--upload-slots", "1", "--groups-per-step", "12")
            samplers = []
            for i, host in enumerate(hosts):
                samplers.append(swarm.spawn(host, f"s{i}", [
                    "sampler", "--transport", transport, "--peers", addr, "--run-id", "wan", "--learner-key", key,
                    "--sampler-id", f"s{i}", "--run-dir", f"runs/s{i}", *QUICK_SAMPLER], run_dir=Path(f"runs/s{i}")))
            for proc in samplers:
                swarm.ready(proc)
            wait_for(lambda: all(len(fetched(s.run_dir)) >= 4 for s in samplers), 240, "four versions at every sampler", swarm)
            wait_for(lambda: len(steps_of(learner.run_dir)) >= 1, 60, "a learner step record", swarm)
        finally:
            swarm.stop_all()
    fetches = [f for s in samplers for f in fetched(s.run_dir)]
    relayed = [f for f in fetches if f["relayed"]]
    uploaded = steps_of(learner.run_dir)[-1]["uploaded_bytes"]
    fetched_bytes = sum(f["bytes"] for f in fetches)
    print(f"{len(fetches)} fetches ({fetched_bytes} bytes), {len(relayed)} relayed; the learner uploaded {uploaded} bytes")
    assert relayed, fetches
    # relays and stripes: the learner uploads less than the samplers receive (a sampler that falls
    # more than one version behind still takes a chain or snapshot whole, often from the learner)
    assert uploaded < fetched_bytes, (uploaded, fetched_bytes)


def start_holder(swarm: WanSwarm, host, name: str, addr: str, transport: str, *options: str) -> tuple:
    """A tests/helpers/wan_weights.py holder of version 0 on `host`: (process, its ready.json)."""
    out = swarm.home(host) / name
    proc = swarm.spawn(host, name, ["serve", "--transport", transport, "--peers", addr, "--out", str(out), *options],
                       program=[sys.executable, SCRIPT])
    wait_for(lambda: (out / "ready.json").exists() or proc.popen.poll() is not None, 60, f"{name} ready", swarm)
    assert proc.popen.poll() is None, proc.text()[-2000:]
    return proc, json.loads((out / "ready.json").read_text())


def fetch(swarm: WanSwarm, host, addr: str, transport: str, holders: list[str], digest: str):
    """Start a tests/helpers/wan_weights.py fetch on `host`; (process, the file it writes its result to)."""
    out = swarm.home(host) / "fetched.json"
    proc = swarm.spawn(host, "fetcher", ["fetch", "--transport", transport, "--peers", addr, "--out", str(out),
                                         "--holders", ",".join(holders), "--hash", digest],
                       program=[sys.executable, SCRIPT])
    return proc, out


def bootstrap(swarm: WanSwarm, host, transport: str) -> str:
    boot = swarm.spawn(host, "bootstrap", ["bootstrap", "--transport", transport, "--run-id", "wan-relay"])
    return swarm.ready(boot)["addresses"][0]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_holder_killed_mid_transfer_is_passed_over(tmp_path, transport):
    """A holder on a 2 Mbit/s link is SIGKILLed while it sends a 3 MB version: the fetch goes on
    to the next holder and the version it keeps is the announced one, bit for bit."""
    with Wan() as wan:
        a, slow, fast, f = wan.host("a"), wan.host("slow", rate_mbit=2), wan.host("fast"), wan.host("f")
        swarm = WanSwarm(wan, tmp_path)
        try:
            addr = bootstrap(swarm, a, transport)
            doomed, first = start_holder(swarm, slow, "slow", addr, transport, "--megabytes", "3")
            _, second = start_holder(swarm, fast, "fast", addr, transport, "--megabytes", "3")
            sent_before = slow.traffic()[1]
            proc, out = fetch(swarm, f, addr, transport, [first["peer_id"], second["peer_id"]], first["hash"])
            wait_for(lambda: slow.traffic()[1] - sent_before > 300_000, 60, "the slow holder sending", swarm, poll_s=0.05)
            doomed.popen.kill()
            assert proc.popen.wait(timeout=120) == 0, proc.text()[-2000:]
        finally:
            swarm.stop_all()
    got = json.loads(out.read_text())
    assert got.get("holder") == second["peer_id"], got
    assert got["hash"] == first["hash"] == second["hash"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_holder_serving_a_corrupt_version_is_passed_over(tmp_path, transport):
    """The first holder serves version 0 with one bit flipped: it is reported (the follower shuns
    it) and the version comes whole from the second holder."""
    with Wan() as wan:
        a, h1, h2, f = (wan.host(n) for n in ("a", "h1", "h2", "f"))
        swarm = WanSwarm(wan, tmp_path)
        try:
            addr = bootstrap(swarm, a, transport)
            _, liar = start_holder(swarm, h1, "liar", addr, transport, "--corrupt")
            _, honest = start_holder(swarm, h2, "honest", addr, transport)
            proc, out = fetch(swarm, f, addr, transport, [liar["peer_id"], honest["peer_id"]], honest["hash"])
            assert proc.popen.wait(timeout=120) == 0, proc.text()[-2000:]
        finally:
            swarm.stop_all()
    got = json.loads(out.read_text())
    assert got.get("holder") == honest["peer_id"] and got["corrupt"] == [liar["peer_id"]], got
    assert got["hash"] == honest["hash"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_peer_serving_corrupt_chunks_is_struck_and_the_version_still_arrives(tmp_path, transport):
    """A learner on a 20 Mbit/s link announces a 4 MB version in chunks; three samplers pass it
    along a chain, its head serving every chunk with a flipped byte. The one after it strikes it
    (it is shunned) and takes the chunks from the learner instead; both honest ones hold the
    announced version bit for bit, with none of its bytes."""
    with Wan() as wan:
        a, b = wan.host("a"), wan.host("b", rate_mbit=20)
        hosts = [wan.host(f"s{i}", rate_mbit=50) for i in range(3)]
        swarm = WanSwarm(wan, tmp_path)
        try:
            addr = bootstrap(swarm, a, transport)
            _, learner = start_holder(swarm, b, "learner", addr, transport, "--megabytes", "4", "--announce")
            outs = []
            for i, host in enumerate(hosts):
                outs.append(swarm.home(host) / f"s{i}")
                swarm.spawn(host, f"s{i}", ["follow", "--transport", transport, "--peers", addr, "--out", str(outs[-1]),
                                            "--key", learner["key"]], program=[sys.executable, SCRIPT])
            wait_for(lambda: all((o / "ready.json").exists() for o in outs), 60, "the samplers joined", swarm)
            # the chain runs in the order of peer ids: the first is the liar, asked by the second
            outs.sort(key=lambda o: json.loads((o / "ready.json").read_text())["peer_id"])
            (outs[0] / "corrupt").touch()
            liar = json.loads((outs[0] / "ready.json").read_text())["peer_id"]
            time.sleep(3)  # their records (relaying, holding nothing) reach each other: they share the version out
            (swarm.home(b) / "learner" / "go").touch()
            wait_for(lambda: all((o / "fetched.json").exists() for o in outs), 120, "the version at every sampler", swarm)
        finally:
            swarm.stop_all()
    for out in outs[1:]:
        got = json.loads((out / "fetched.json").read_text())
        assert got["hash"] == learner["hash"] and got["sources"], got  # in chunks, bit for bit
        assert liar not in got["sources"], got
    assert liar in json.loads((outs[1] / "shunned.json").read_text())
