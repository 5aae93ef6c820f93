"""Two learners of one run (the owner's and a certified one) on two samplers, stalled in turn: every
4-12 s one of them, chosen at random, is stopped whole (SIGSTOP to its process group: its DHT, p2p
daemon and averager too) for GEPO_STALLS_STALL_S seconds, as a machine that swaps, a preempted
VM or a long garbage collection would. Rounds then find no group while both are present.

The figure that matters is `forks`: version numbers both learners published under different
hashes. Each learner stepping alone used to publish the next version number under its own weights
(samplers then held one, learners verified against the other). Only one learner steps alone now
(swarm.team.leader_of); the other takes its version (`yielded`).

    python -m benchmarks learner_stalls      # about 4 minutes on 2 cores

Env: GEPO_STALLS_WINDOW_S (seconds of stalls, default 150), GEPO_STALLS_STALL_S (6),
GEPO_STALLS_SEED (1). Writes benchmarks/results/learner_stalls.{json,md}.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common import markdown_table, write_result
from benchmarks.learners import certify, peer_ready, spawn_peer
from swarm.runlog import read_jsonl

LEARNER_ARGS = ["--steps", "100000", "--checkpoint-every", "0", "--max-completion-length", "12", "--groups-per-step", "2",
                "--averaging-timeout-s", "3"]


def measure(window_s: float, stall_s: float, seed: int, root: Path) -> dict:
    procs: dict[str, subprocess.Popen] = {}
    log = (root / "peers.log").open("w")

    def spawn(name: str, args: list[str]) -> None:
        procs[name] = spawn_peer(args, log, own_session=True)  # a process group of its own, stopped whole

    try:
        spawn("boot", ["bootstrap", "--host", "127.0.0.1", "--port", "0", "--identity", str(root / "boot.key"),
                       "--run-dir", str(root / "boot")])
        addr = peer_ready(root / "boot", procs["boot"], root)["addresses"][0]
        spawn("owner", ["learner", "--peers", addr, "--run-dir", str(root / "owner"), "--identity-dir", str(root / "owner-id"),
                        *LEARNER_ARGS])
        owner = peer_ready(root / "owner", procs["owner"], root)
        for name in ("s1", "s2"):
            spawn(name, ["sampler", "--peers", addr, "--learner-key-file", str(root / "owner" / "learner.key"),
                         "--prompts-per-round", "2", "--num-generations", "4", "--identity-dir", str(root / f"{name}-id"),
                         "--run-dir", str(root / name)])
        cert = certify(root / "second-id", owner["owner_key_file"])
        spawn("second", ["learner", "--peers", addr, "--run-dir", str(root / "second"), "--identity-dir",
                         str(root / "second-id"), "--certificate", cert, *LEARNER_ARGS])
        peer_ready(root / "second", procs["second"], root)
        chooser, stalls = random.Random(seed), {"owner": 0, "second": 0}
        end = time.time() + window_s
        while time.time() < end:
            time.sleep(chooser.uniform(4, 12))
            who = chooser.choice(["owner", "second"])
            os.killpg(procs[who].pid, signal.SIGSTOP)
            try:
                time.sleep(stall_s)
            finally:
                os.killpg(procs[who].pid, signal.SIGCONT)
            stalls[who] += 1
            dead = [name for name, proc in procs.items() if proc.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited; see {root / 'peers.log'}:\n{(root / 'peers.log').read_text()[-3000:]}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()

    def events(name: str) -> list[dict]:
        path = root / name / "events.jsonl"
        return read_jsonl(path) if path.exists() else []

    published = {name: {e["version"]: e["hash"] for e in events(name) if e["event"] == "published"} for name in ("owner", "second")}
    both = sorted(set(published["owner"]) & set(published["second"]))
    steps = {name: read_jsonl(root / name / "steps.jsonl") for name in ("owner", "second")}
    team = {name: (rows[-1].get("team") or {}) if rows else {} for name, rows in steps.items()}
    return {"window_s": window_s, "stall_s": stall_s, "seed": seed, "stalls": stalls,
            "published": {name: len(p) for name, p in published.items()}, "published_by_both": len(both),
            "forks": [v for v in both if published["owner"][v] != published["second"][v]],
            "stepped_alone": {name: t.get("alone", 0) for name, t in team.items()},
            "yielded": {name: t.get("yielded", 0) for name, t in team.items()},
            "state_downloads": {name: sum(e["event"] == "state_downloaded" for e in events(name)) for name in published},
            "steps": {name: len(rows) for name, rows in steps.items()},
            "groups_trained": {name: rows[-1].get("used_total", 0) if rows else 0 for name, rows in steps.items()},
            "groups_held_over": {name: rows[-1].get("groups_held_over", 0) if rows else 0 for name, rows in steps.items()}}


def run() -> None:
    window_s = float(os.environ.get("GEPO_STALLS_WINDOW_S", 150))
    stall_s = float(os.environ.get("GEPO_STALLS_STALL_S", 6))
    seed = int(os.environ.get("GEPO_STALLS_SEED", 1))
    with tempfile.TemporaryDirectory(prefix="gepo-learner-stalls-") as tmp:
        result = measure(window_s, stall_s, seed, Path(tmp))
    print(f"[learner_stalls] {result}", flush=True)
    rows = [[name, result["stalls"][name], result["steps"][name], result["published"][name], result["stepped_alone"][name],
             result["yielded"][name], result["state_downloads"][name], result["groups_trained"][name],
             result["groups_held_over"][name]] for name in ("owner", "second")]
    markdown = (
        f"# Two learners stalled in turn ({window_s:.0f} s, {stall_s:.0f} s stalls every 4-12 s, seed {seed})\n\n"
        f"Versions both published: {result['published_by_both']}; **published under two different hashes: "
        f"{len(result['forks'])}** {result['forks'] or ''}\n\n"
        + markdown_table(["learner", "stalls", "steps", "versions published", "stepped alone", "yielded", "state downloads",
                          "groups trained on", "groups held over"],
                         rows)
        + "\n`python -m benchmarks learner_stalls` (swarm/team.py: only the owner's learner steps alone while both are "
          "present; the other takes its version)\n")
    write_result("learner_stalls", result, markdown)
