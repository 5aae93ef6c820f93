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

from swarm.health import STALL_MIN_S

SWARM = [sys.executable, "-m", "swarm.cli"]
ENV = dict(os.environ, PYTHONUNBUFFERED="1")


def spawn(*args, log):
    return subprocess.Popen([*SWARM, *args], stdout=log, stderr=subprocess.STDOUT, env=ENV, text=True)


def test_bootstrap_learner_and_sampler_train_together(tmp_path):
    """Peers started by hand (not through the launcher); what the test needs from them it reads from
    the files they write: ready.json, the learner's steps.jsonl, the sampler's and the bootstrap
    node's events.jsonl."""
    from swarm.runlog import read_jsonl, wait_ready

    procs = []

    def ready(run_dir, proc):
        found = wait_ready(run_dir, timeout_s=120, alive=lambda: proc.poll() is None)
        assert found is not None, (tmp_path / "logs").read_text() if (tmp_path / "logs").exists() else "no ready.json"
        return found

    try:
        log = (tmp_path / "peers.log").open("w")
        procs.append(spawn("bootstrap", "--host", "127.0.0.1", "--port", "0", "--identity", str(tmp_path / "boot.key"),
                           "--status-every-s", "1", "--run-dir", str(tmp_path / "boot"), log=log))
        addr = ready(tmp_path / "boot", procs[0])["addresses"][0]
        # a checkpoint that cannot be written (here `checkpoints` is a file; a full disk alike) is
        # reported and training goes on
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "checkpoints").write_text("")
        # the run's sampling settings are the learner's: samplers take them from its announcements;
        # it trains under bfloat16 autocast and publishes bfloat16 versions. Groups at most one version
        # behind: six steps of a tiny model take a second on a quiet machine, over before its niced
        # encoding process has published a version the sampler could fetch, had it taken version 0's
        procs.append(spawn("learner", "--peers", addr, "--steps", "6", "--groups-per-step", "2", "--max-staleness", "1", "--run-dir",
                           str(tmp_path / "run"), "--identity-dir", str(tmp_path / "learner"), "--checkpoint-every", "3",
                           "--temperature", "0.9", "--top-p", "0.95", "--max-completion-length", "12",
                           "--verify-fraction", "1", "--dtype", "bfloat16", "--stop-strings", "Question:", log=log))
        learner_ready = ready(tmp_path / "run", procs[1])
        key = learner_ready["learner_key"]
        assert (tmp_path / "run" / "learner.key").read_text().strip() == key
        status = subprocess.run([*SWARM, "status", "--peers", addr, "--learner-key", key, "--json"], capture_output=True, text=True,
                                env=ENV, timeout=120)
        assert status.returncode == 0, status.stderr[-2000:]
        report = json.loads(status.stdout)
        assert report["learner_version"] == 0 and [p["role"] for p in report["peers"]] == ["learner"]
        # what looks wrong: a learner alone gets no rollouts (and it is not late, nor stalled yet: on a
        # loaded machine whose `swarm status` took past the stall threshold since the learner was
        # ready, stalled it rightly is by then)
        stalled_by_now = time.time() - learner_ready["time"] > STALL_MIN_S
        kinds = [f["kind"] for f in report["flags"]]
        assert kinds[0] == "no_sampler" and set(kinds[1:]) <= ({"learner_stalled"} if stalled_by_now else set()), report["flags"]
        assert report["flags"][0]["command"] == f"swarm status --peers {addr} --run-id {report['run_id']} --watch 5"
        procs.append(spawn("sampler", "--peers", addr, "--learner-key-file", str(tmp_path / "run" / "learner.key"),
                           "--prompts-per-round", "2", "--num-generations", "4",
                           "--identity-dir", str(tmp_path / "sampler"), "--run-dir", str(tmp_path / "sampler-run"),
                           "--progress-every-s", "1", log=log))
        assert procs[1].wait(timeout=300) == 0, (tmp_path / "peers.log").read_text()[-3000:]
        events = tmp_path / "sampler-run" / "events.jsonl"
        deadline = time.time() + 30
        while time.time() < deadline and not any(e["event"] == "version_used" and e["version"] >= 1 for e in read_jsonl(events)):
            time.sleep(0.3)
        # the learner announced the end of its run: the sampler leaves on its own (it used to run until stopped)
        assert procs[2].wait(timeout=60) == 0, (tmp_path / "peers.log").read_text()[-3000:]
        assert "the learner ended the run at version 6; stopping" in (tmp_path / "peers.log").read_text()

        steps = read_jsonl(tmp_path / "run" / "steps.jsonl")
        assert [int(s["version"]) for s in steps] == [1, 2, 3, 4, 5, 6]
        assert all(s["learning_rate"] > 0 for s in steps)
        # every group's log-probs were recomputed, and the sampler's (another process) matched
        assert steps[-1]["verified"] >= steps[-1]["used_total"] and 0 <= steps[-1]["largest_honest_gap"] < 0.01
        learner_events = read_jsonl(tmp_path / "run" / "events.jsonl")
        assert learner_events[-1]["event"] == "stopped" and learner_events[-1]["version"] == 6
        assert [e["version"] for e in learner_events if e["event"] == "checkpoint_failed"] == [3, 6, 6]  # every 3, at exit
        sampler_events = read_jsonl(events)
        sampling = next(e for e in sampler_events if e["event"] == "sampling")
        assert (sampling["temperature"], sampling["top_p"], sampling["max_tokens"], sampling["stop"]) == (0.9, 0.95, 12, ["Question:"])
        used = [e["version"] for e in sampler_events if e["event"] == "version_used"]
        assert used and max(used) >= 1, sampler_events[-5:]  # followed the learner
        fetched = [e for e in sampler_events if e["event"] == "version_fetched"]
        assert fetched and all(e["bytes"] > 0 and e["holder"] == report["peers"][0]["peer_id"] for e in fetched)
        assert fetched[0]["kinds"] == ["snapshot"]  # a new sampler starts from a snapshot, then takes deltas
        # everything the learner refused is named; only groups sent after it left may be lost
        stopped = sampler_events[-1]
        named = {"learner unreachable", "the learner is leaving"}
        assert stopped["event"] == "stopped" and all(reason in named or re.fullmatch(r"version \d+ is \d+ steps stale \(max 1\)", reason)
                                                     for reason in stopped["refused"]), stopped
        assert stopped["sent"] == sum(e["accepted"] for e in sampler_events if e["event"] == "sent") > 0
        statuses = [e for e in read_jsonl(tmp_path / "boot" / "events.jsonl") if e["event"] == "status"]
        assert any(e["learners"] == 1 and e["samplers"] == 1 for e in statuses), statuses[-3:]
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
    "args, message, status",
    [
        (["sampler", "--peers", DEAD, "--learner-key", "W293bmVyOnNzaC1yc2EgQUFBQV0="], "could not join the swarm through", 1),
        (["learner", "--peers", DEAD], "could not join the swarm through", 1),
        (["sampler", "--peers", DEAD, "--learner-key", "bm9wZQ=="], "not the token a learner prints", 2),
        (["learner", "--peers", DEAD, "--loss", "ppo"], "'ppo' is not one of 'gepo', 'grpo'", 2),
        (["learner"], "--peers: no --peers given", 2),
        (["status", "--peers", DEAD], "could not join the swarm through", 1),
        (["learner", "--peers", DEAD, "--model", "./missing-model"], "model directory ./missing-model does not exist", 2),
        (["sampler", "--peers", DEAD, "--learner-key", "W293bmVyOnNzaC1yc2EgQUFBQV0=", "--task", "nope.jsonl"], "nope.jsonl does not exist", 2),
        (["learner", "--peers", "127.0.0.1:9", "--transport", "grpc"], "could not join the swarm through the registry at 127.0.0.1:9", 1),
        (["learner", "--peers", DEAD, "--transport", "grpc"], "with --transport grpc pass the registry's HOST:PORT", 2),
        (["status", "--peers", "127.0.0.1:9", "--transport", "grpc"], "could not join the swarm through the registry", 1),
        (["bootstrap", "--host", "localhost"], "'localhost' is not an IP address to listen on", 2),
        (["bootstrap", "--host", "127.0.0.1", "--port", "{busy}"], "the port is taken on 127.0.0.1", 1),
        (["bootstrap", "--transport", "grpc", "--host", "127.0.0.1", "--port", "{busy}"], "the port is taken on 127.0.0.1", 1),
        (["learner", "--peers", "{registry}", "--transport", "grpc", "--port", "{busy}"], "--port {busy}: the port is taken on 0.0.0.0", 1),
        (["learner", "--peers", DEAD, "--run-dir", "{file}"], "is a file, not a directory", 2),
        (["sampler", "--peers", DEAD, "--learner-key-file", "missing.key"], "--learner-key-file missing.key", 2),
        # (a peer that accepts connections: nothing listening is said first, before the backend loads)
        (["sampler", "--peers", "{listening}", "--learner-key", "W293bmVyOnNzaC1yc2EgQUFBQV0=", "--backend", "vllm"],
         "the vllm backend needs the optional extra", 1),
        # nothing listening at --peers is said before the model loads (here a directory that holds none)
        (["learner", "--peers", DEAD, "--model", "{empty}"], "could not join the swarm through", 1),
        (["sampler", "--peers", DEAD, "--learner-key", "W293bmVyOnNzaC1yc2EgQUFBQV0=", "--model", "{empty}"],
         "could not join the swarm through", 1),
    ],
)
def test_bad_addresses_and_options_fail_fast(args, message, status, tmp_path):
    """Bad input is a usage error (exit 2); a swarm that cannot be reached, a port in use or a
    missing optional extra, a failure (exit 1): one line each, never a traceback."""
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    registry = None
    if "{registry}" in args:
        from swarm.fabric.grpc.registry import GrpcBootstrap

        registry = GrpcBootstrap("swarm", host="127.0.0.1", port=0)
    (tmp_path / "a-file").write_text("")
    (tmp_path / "empty-model").mkdir()
    names = {"{busy}": str(busy.getsockname()[1]), "{file}": str(tmp_path / "a-file"),
             "{registry}": registry.addresses()[0] if registry else "", "{empty}": str(tmp_path / "empty-model"),
             "{listening}": DEAD.replace("/tcp/9/", f"/tcp/{busy.getsockname()[1]}/")}
    args = [names.get(a, a) for a in args]
    started = time.time()
    extra = ["--identity-dir", str(tmp_path)] if args[0] in ("learner", "sampler") and args[1:] else []
    if args[0] != "status" and "--run-dir" not in args and args[1:]:
        extra += ["--run-dir", str(tmp_path / "run")]
    try:
        out = subprocess.run([*SWARM, *args, *extra], capture_output=True, text=True, env=ENV, timeout=120)
    finally:
        busy.close()
        if registry is not None:
            registry.shutdown()
    assert out.returncode == status, out.stderr[-2000:]
    assert message.replace("{busy}", names["{busy}"]) in out.stderr, out.stderr[-2000:]
    if "could not join" in message:  # port 9 refuses connections: said at once, not after the transport's retries
        assert "connection refused" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert time.time() - started < 30
    if args[0] in ("learner", "sampler"):
        assert not (tmp_path / "run").exists()  # a failed start leaves no half-made run directory


@pytest.mark.parametrize("transport", ["hivemind", "grpc"])
def test_sampler_lag_steps_keeps_its_rollouts_that_many_versions_behind(tmp_path, transport):
    """Peers as processes over each transport; the sampler simulates latency with --lag-steps."""
    from swarm.cli.launcher import LocalSwarm

    swarm = LocalSwarm(tmp_path, run_id="lag", transport=transport)
    try:
        addr = swarm.start_bootstrap()
        learner, key = swarm.start_learner(addr, "--steps", "10", "--groups-per-step", "2", "--checkpoint-every", "0",
                                           run_dir=tmp_path / "run")
        swarm.start_sampler("sampler-0", addr, key, "--prompts-per-round", "2", "--num-generations", "4", "--lag-steps", "3")
        assert learner.popen.wait(timeout=300) == 0, learner.text()[-3000:]
    finally:
        swarm.stop_all()
    steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    late = [s for s in steps if s["version"] > 5]  # once versions 3 behind exist
    assert late and all(s["staleness_min"] >= 3 for s in late), [s["staleness_min"] for s in steps]
    assert all(sum(s["staleness_hist"].values()) == 2 for s in steps)
