"""The swarm across machines: real `swarm` processes, each "machine" a network namespace of the WAN
harness (benchmarks/wan.py) with its own address, working directory and keys; NAT routers
MASQUERADE their LANs. Nothing here runs on 127.0.0.1 between peers.

There is no delay emulation here (the kernel has no netem): links are as fast as the namespaces'
veths unless shaped, and round-trip times are those of the loopback device.
"""

from __future__ import annotations

import json
import shlex
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.wan import Wan, forward_port, sweep_stale, wan_unavailable
from benchmarks.wan_swarm import SWARM, WanSwarm, pids_in, records, wait_for

UNAVAILABLE = wan_unavailable(nat=True)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(UNAVAILABLE is not None, reason=f"WAN harness: {UNAVAILABLE}")]
README = Path(__file__).resolve().parents[2] / "README.md"
TRANSPORTS = ["hivemind", "grpc"]
# small rounds and steps, so that a test sees several versions in seconds
QUICK_LEARNER = ["--groups-per-step", "4", "--checkpoint-every", "0", "--wait-s", "30", "--steps", "1000"]
QUICK_SAMPLER = ["--prompts-per-round", "2", "--num-generations", "4"]


@pytest.fixture(scope="module", autouse=True)
def _no_leftovers():
    """Namespaces a killed earlier run left behind (their owner's pid is gone) are removed first."""
    sweep_stale()


def readme_commands() -> list[list[str]]:
    """The commands of the README's "A swarm across machines" block, after `bash dev.sh swarm`."""
    text = README.read_text()
    section = text[text.index("## A swarm across machines"):]
    block = section[section.index("```bash") + len("```bash"):section.index("```", section.index("```bash") + 7)]
    commands = []
    for line in block.strip().splitlines():
        words = shlex.split(line.split("#", 1)[0])
        assert words[:3] == ["bash", "dev.sh", "swarm"], line
        commands.append(words[3:])
    return commands


def fill(words: list[str], transport: str, **values: str) -> list[str]:
    """A README command with ADDR and KEY filled in; over gRPC with the README's `--transport grpc`."""
    filled = [values.get(w, w) for w in words]
    return filled[:1] + (["--transport", "grpc"] if transport == "grpc" else []) + filled[1:]


def steps_of(run_dir: Path) -> list[dict]:
    return records(run_dir, "steps.jsonl")


def fetched(run_dir: Path) -> list[dict]:
    return [e for e in records(run_dir) if e.get("event") == "version_fetched"]


def status_json(swarm: WanSwarm, host, addr: str, transport: str, run_id: str = "swarm") -> dict:
    done = host.run([*SWARM, "status", "--peers", addr, "--run-id", run_id, "--transport", transport, "--json"],
                    timeout=180, cwd=swarm.home(host))  # a python start on a loaded machine alone can take a minute
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_readme_commands_work_across_machines_as_written(tmp_path, transport):
    """Bootstrap, learner and sampler on three machines, each started with the README's command
    line as written (plus the README's `--transport grpc`); `swarm status` from a fourth lists both
    peers with the sampler's last fetch."""
    boot_cmd, learner_cmd, sampler_cmd, status_cmd = readme_commands()
    with Wan() as wan:
        a, b, c, d = (wan.host(n) for n in "abcd")
        swarm = WanSwarm(wan, tmp_path)
        try:
            boot = swarm.spawn(a, "bootstrap", fill(boot_cmd, transport))
            addr = swarm.ready(boot)["addresses"][0]
            assert a.ip in addr, f"the bootstrap's first address {addr} is not the one others reach it at ({a.ip})"
            learner = swarm.spawn(b, "learner", fill(learner_cmd, transport, ADDR=addr), run_dir=Path("runs/r1"))
            key = swarm.ready(learner)["learner_key"]
            sampler = swarm.spawn(c, "sampler", fill(sampler_cmd, transport, ADDR=addr, KEY=key))
            swarm.ready(sampler)
            wait_for(lambda: len(steps_of(learner.run_dir)) >= 2, 240, "two learner steps on the sampler's groups", swarm)
            wait_for(lambda: fetched(sampler.run_dir) and fetched(sampler.run_dir)[-1]["version"] >= 1, 60,
                     "the sampler fetching a trained version", swarm)
            with ThreadPoolExecutor(2) as both:  # as written, and its --json to read; side by side
                as_written = both.submit(d.run, [*SWARM, *fill(status_cmd, transport, ADDR=addr)], timeout=60,
                                         cwd=swarm.home(d))
                status = both.submit(status_json, swarm, d, addr, transport).result()
                shown = as_written.result()
            assert shown.returncode == 0, shown.stderr[-2000:]
        finally:
            swarm.stop_all()
    roles = sorted(p["role"] for p in status["peers"])
    assert roles == ["learner", "sampler"], status
    sampler_row = next(p for p in status["peers"] if p["role"] == "sampler")
    assert sampler_row["last_fetch"] is not None and sampler_row["last_fetch"]["bytes"] > 0, sampler_row
    assert sampler_row["holds"], sampler_row  # a public sampler offers the versions it holds to relay
    learner_row = next(p for p in status["peers"] if p["role"] == "learner")
    assert b.ip in learner_row["peer_id"] or transport == "hivemind", learner_row  # gRPC ids carry the dialled address
    used = steps_of(learner.run_dir)
    assert sum(s["groups"] for s in used) >= 2, used


def start_run(swarm: WanSwarm, boot_host, learner_host, transport: str, *learner_options: str):
    """A bootstrap and a learner (run directory runs/r1 on its host); (address, learner proc, key)."""
    boot = swarm.spawn(boot_host, "bootstrap", ["bootstrap", "--transport", transport, "--run-id", "wan"])
    addr = swarm.ready(boot)["addresses"][0]
    learner = swarm.spawn(learner_host, "learner", ["learner", "--transport", transport, "--peers", addr, "--run-id", "wan",
                                                    "--run-dir", "runs/r1", *QUICK_LEARNER, *learner_options],
                          run_dir=Path("runs/r1"))
    return addr, learner, swarm.ready(learner)["learner_key"]


def start_sampler(swarm: WanSwarm, host, name: str, addr: str, key: str, transport: str, *options: str, wait: bool = True):
    """A sampler on `host`, ready (`wait`), or still starting: several then start side by side."""
    proc = swarm.spawn(host, name, ["sampler", "--transport", transport, "--peers", addr, "--run-id", "wan",
                                    "--learner-key", key, "--sampler-id", name, "--run-dir", f"runs/{name}",
                                    *QUICK_SAMPLER, *options], run_dir=Path(f"runs/{name}"))
    if wait:
        swarm.ready(proc)
    return proc


def accepted(run_dir: Path) -> int:
    return sum(e.get("accepted", 0) for e in records(run_dir) if e.get("event") == "sent")


def versions_fetched(run_dir: Path) -> set[int]:
    return {e["version"] for e in fetched(run_dir)}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_samplers_behind_nats_with_the_same_private_address_stream_follow_and_stay_distinct(tmp_path, transport):
    """Two homes behind MASQUERADE routers, the same LAN subnet, a sampler at 192.168.77.10 port
    40001 in each, started with the plain command: the learner trains on both one's groups, both
    fetch the versions that follow, and the swarm lists them as two peers (identity by key)."""
    with Wan() as wan:
        a, b = wan.host("a"), wan.host("b")
        samplers, hosts = [], []
        swarm = WanSwarm(wan, tmp_path)
        try:
            addr, learner, key = start_run(swarm, a, b, transport)
            for i in range(2):
                host = wan.behind(wan.nat(f"home{i}"), f"s{i}", ip="192.168.77.10")
                hosts.append(host)
                samplers.append(start_sampler(swarm, host, f"twin{i}", addr, key, transport, "--port", "40001", wait=False))
            for sampler in samplers:
                swarm.ready(sampler)
            wait_for(lambda: all(accepted(s.run_dir) >= 2 and len(versions_fetched(s.run_dir)) >= 2 for s in samplers),
                     180, "both twins' groups accepted and a version after the first fetched behind the NATs", swarm)
            status = status_json(swarm, a, addr, transport, run_id="wan")
        finally:
            swarm.stop_all()
    rows = [p for p in status["peers"] if p["role"] == "sampler"]
    assert len({p["peer_id"] for p in rows}) == 2, status
    assert len({s.ready["peer_id"] for s in samplers}) == 2
    assert len(steps_of(learner.run_dir)) >= 2
    if transport == "grpc":  # each knows it is behind a NAT (the registry sees another address): it offers nothing to relay
        for row in rows:
            port = row["peer_id"].rsplit(":", 1)[1]
            assert row["holds"] == [] and any(row["peer_id"].endswith(f"@{h.public_ip}:{port}") for h in hosts), row


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_learner_sigkilled_leaves_nothing_behind_and_resumes_with_its_key(tmp_path, transport):
    """SIGKILL the learner: nothing of it is left on its machine (no DHT process, no p2pd holding
    its port or identity); `--resume` comes back under the same key, and the sampler, pinned to
    that key, fetches the versions it publishes after."""
    with Wan() as wan:
        a, b, c = wan.host("a"), wan.host("b"), wan.host("c")
        swarm = WanSwarm(wan, tmp_path)
        try:
            addr, learner, key = start_run(swarm, a, b, transport, "--checkpoint-every", "1", "--port", "40000")
            sampler = start_sampler(swarm, c, "s0", addr, key, transport)
            wait_for(lambda: len(steps_of(learner.run_dir)) >= 2, 180, "two steps before the kill", swarm)
            learner.popen.kill()
            learner.popen.wait(10)
            wait_for(lambda: not pids_in(b), 10, "every process of the killed learner gone from its machine", swarm)
            before = max(versions_fetched(sampler.run_dir))
            again = swarm.spawn(b, "learner-2", ["learner", "--transport", transport, "--peers", addr, "--run-id", "wan",
                                                 "--run-dir", "runs/r1", "--resume", *QUICK_LEARNER, "--port", "40000"],
                                run_dir=Path("runs/r1"))
            assert swarm.ready(again)["learner_key"] == key
            wait_for(lambda: max(versions_fetched(sampler.run_dir)) > before + 1, 180,
                     "the sampler fetching the resumed learner's versions", swarm)
        finally:
            swarm.stop_all()
    assert sampler.popen.returncode in (0, -15), sampler.text()[-2000:]


def test_learner_behind_nat_is_reached_by_public_samplers(tmp_path):
    """hivemind: a learner behind a NAT, started with the plain command, trains on a public
    sampler's groups and serves it versions: its p2p daemon dials out to the peers it learns of,
    and streams then travel over that connection (no relay: the bootstrap carries none of it)."""
    with Wan() as wan:
        a, c = wan.host("a"), wan.host("c")
        b = wan.behind(wan.nat("home"), "b")
        swarm = WanSwarm(wan, tmp_path)
        try:
            addr, learner, key = start_run(swarm, a, b, "hivemind")
            sampler = start_sampler(swarm, c, "s0", addr, key, "hivemind")
            wait_for(lambda: len(versions_fetched(sampler.run_dir)) >= 3, 120, "versions from a NATed learner", swarm)
            through_bootstrap = a.traffic()
        finally:
            swarm.stop_all()
    assert accepted(sampler.run_dir) >= 8
    assert max(through_bootstrap) < fetched(sampler.run_dir)[0]["bytes"], "the version went through the bootstrap"


def test_grpc_learner_behind_nat_with_a_forwarded_port_and_announced_address(tmp_path):
    """gRPC: a learner behind a NAT that forwards TCP 40000 to it, started with the README's
    --announce-addr line: samplers reach it at the announced address and train."""
    with Wan() as wan:
        a, c = wan.host("a"), wan.host("c")
        home = wan.nat("home")
        b = wan.behind(home, "b")
        forward_port(home, 40000, b)
        swarm = WanSwarm(wan, tmp_path)
        try:
            addr, learner, key = start_run(swarm, a, b, "grpc", "--port", "40000", "--announce-addr", f"{home.ip}:40000")
            assert learner.ready["peer_id"].endswith(f"@{home.ip}:40000"), learner.ready
            sampler = start_sampler(swarm, c, "s0", addr, key, "grpc")
            wait_for(lambda: len(versions_fetched(sampler.run_dir)) >= 3, 120, "versions from the forwarded learner", swarm)
        finally:
            swarm.stop_all()
    assert accepted(sampler.run_dir) >= 8
