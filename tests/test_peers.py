"""The peers as real processes on loopback: a bootstrap node, a learner and a sampler train
together; bad addresses and options fail fast with clear messages."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

SWARM = [sys.executable, "-m", "swarm.cli"]
ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def spawn(*args, log):
    return subprocess.Popen([*SWARM, *args], stdout=log, stderr=subprocess.STDOUT, env=ENV, text=True)


def wait_for_line(path, pattern, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        match = re.search(pattern, path.read_text())
        if match:
            return match
        if proc.poll() is not None:
            break
        time.sleep(0.3)
    raise AssertionError(f"no {pattern!r} in {path.name}:\n{path.read_text()[-3000:]}")


def test_bootstrap_learner_and_sampler_train_together(tmp_path):
    procs = []
    try:
        boot_log = tmp_path / "boot.log"
        with boot_log.open("w") as log:
            procs.append(spawn("bootstrap", "--host", "127.0.0.1", "--port", "0", "--identity", str(tmp_path / "boot.key"),
                               "--status-every", "2", log=log))
        addr = wait_for_line(boot_log, r"--peers (\S+)", procs[0]).group(1)
        learner_log = tmp_path / "learner.log"
        with learner_log.open("w") as log:
            procs.append(spawn("learner", "--peers", addr, "--steps", "6", "--groups-per-step", "2", "--run-dir",
                               str(tmp_path / "run"), "--identity-dir", str(tmp_path / "learner"), log=log))
        key = wait_for_line(learner_log, r"--learner-key (\S+)", procs[1]).group(1)
        status = subprocess.run([*SWARM, "status", "--peers", addr, "--json"], capture_output=True, text=True, env=ENV, timeout=120)
        assert status.returncode == 0, status.stderr[-2000:]
        report = json.loads(status.stdout)
        assert report["learner_version"] == 0 and [p["role"] for p in report["peers"]] == ["learner"]
        sampler_log = tmp_path / "sampler.log"
        with sampler_log.open("w") as log:
            procs.append(spawn("sampler", "--peers", addr, "--learner-key", key, "--prompts-per-round", "2",
                               "--group-size", "4", "--identity-dir", str(tmp_path / "sampler"), log=log))
        assert procs[1].wait(timeout=300) == 0, learner_log.read_text()[-3000:]
        wait_for_line(sampler_log, r"now at version [1-9]", procs[2], timeout=30)  # followed the learner
        procs[2].send_signal(signal.SIGTERM)  # a sampler runs until stopped
        assert procs[2].wait(timeout=60) == 0, sampler_log.read_text()[-3000:]

        steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
        assert [int(s["version"]) for s in steps] == [1, 2, 3, 4, 5, 6]
        assert "learner stopped at version 6" in learner_log.read_text()
        sampler_out = sampler_log.read_text()
        # everything the learner refused is named; only groups sent after it left may be lost
        refused = re.search(r"refused by the learner: (.*)", sampler_out).group(1)
        assert refused == "none" or set(eval(refused)) == {"learner unreachable"}, refused
        assert re.search(r"1 learner\(s\), 1 sampler\(s\)", boot_log.read_text())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()


DEAD = "/ip4/127.0.0.1/tcp/9/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ"


@pytest.mark.parametrize(
    "args, message",
    [
        (["sampler", "--peers", DEAD, "--learner-key", "W293bmVyOnNzaC1yc2EgQUFBQV0="], "could not join the swarm through"),
        (["learner", "--peers", DEAD], "could not join the swarm through"),
        (["sampler", "--peers", DEAD, "--learner-key", "bm9wZQ=="], "not the token a learner prints"),
        (["learner", "--peers", DEAD, "--loss", "ppo"], "unknown loss 'ppo'"),
        (["learner"], "--peers: no --peers given"),
        (["status", "--peers", DEAD], "could not join the swarm through"),
        (["learner", "--peers", DEAD, "--model", "./missing-model"], "model directory ./missing-model does not exist"),
        (["sampler", "--peers", DEAD, "--learner-key", "W293bmVyOnNzaC1yc2EgQUFBQV0=", "--task", "nope.jsonl"], "nope.jsonl does not exist"),
        (["learner", "--peers", "127.0.0.1:9", "--transport", "grpc"], "could not join the swarm through the registry at 127.0.0.1:9"),
        (["learner", "--peers", DEAD, "--transport", "grpc"], "with --transport grpc pass the registry's HOST:PORT"),
        (["status", "--peers", "127.0.0.1:9", "--transport", "grpc"], "could not join the swarm through the registry"),
    ],
)
def test_bad_addresses_and_options_fail_fast(args, message, tmp_path):
    started = time.time()
    extra = ["--identity-dir", str(tmp_path)] if args[0] in ("learner", "sampler") and args[1:] else []
    extra += ["--run-dir", str(tmp_path / "run")] if args[0] == "learner" and args[1:] else []
    out = subprocess.run([*SWARM, *args, *extra],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert time.time() - started < 30


@pytest.mark.parametrize("transport", ["hivemind", "grpc"])
def test_sampler_lag_steps_keeps_its_rollouts_that_many_versions_behind(tmp_path, transport):
    """Peers as processes over each transport; the sampler simulates latency with --lag-steps."""
    from swarm.local_swarm import LocalSwarm

    swarm = LocalSwarm(tmp_path, run_id="lag", transport=transport)
    try:
        addr = swarm.start_bootstrap()
        learner, key = swarm.start_learner(addr, "--steps", "10", "--groups-per-step", "2", "--run-dir", str(tmp_path / "run"),
                                           "--checkpoint-every", "0")
        swarm.start_sampler("sampler-0", addr, key, "--prompts-per-round", "2", "--group-size", "4", "--lag-steps", "3")
        assert learner.popen.wait(timeout=300) == 0, learner.text()[-3000:]
    finally:
        swarm.stop_all()
    steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    late = [s for s in steps if s["version"] > 5]  # once versions 3 behind exist
    assert late and all(s["staleness_min"] >= 3 for s in late), [s["staleness_min"] for s in steps]
    assert all(sum(s["staleness_hist"].values()) == 2 for s in steps)
