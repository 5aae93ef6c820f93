"""One learner against two on the same samplers (real processes on loopback): groups consumed per
second, steps per minute, and the averaging overhead per step as a share of the step's time; then
what one averaging round would cost for a 0.6B-parameter model over a 1 Gbit/s link, from the bytes
each learner sends and receives per round.

    python -m benchmarks learners          # about 6 minutes on 2 cores

Env: GEPO_LEARNERS_WINDOW_S (measured seconds per setting, default 120), GEPO_LEARNERS_SAMPLERS (4).
The bytes per round follow from the protocol, not from a guess: each learner contributes its
gradient as float64 fixed point (8 bytes per parameter, swarm.fabric.hivemind.learner_group), and in
hivemind's butterfly all-reduce each of n members sends (n-1)/n of its vector to the others and
receives as much back. Writes benchmarks/results/learners.{json,md}.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import markdown_table, write_result
from swarm.runlog import read_jsonl, wait_ready

SWARM = [sys.executable, "-m", "swarm.cli"]
REPO = Path(__file__).resolve().parents[1]
QWEN3_06B_PARAMS = 0.6e9  # Qwen3-0.6B, the swarm's GPU reference model (README)
LINK_BYTES_PER_S = 1e9 / 8  # 1 Gbit/s


def spawn_peer(args: list[str], log, *, own_session: bool = False) -> subprocess.Popen:
    return subprocess.Popen([*SWARM, *args], stdout=log, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
                            cwd=REPO, start_new_session=own_session)  # this checkout's code, whatever is installed


def measure(learners: int, samplers: int, window_s: float, root: Path) -> dict:
    """Starts a swarm with `learners` learners and `samplers` samplers; once every learner steps,
    counts steps and groups for `window_s` seconds (from the learners' steps.jsonl)."""
    procs: list[subprocess.Popen] = []
    log = (root / "peers.log").open("w")
    args = ["--steps", "100000", "--groups-per-step", "8", "--checkpoint-every", "0", "--max-completion-length", "12",
            "--verify-fraction", "0", "--averaging-timeout-s", "20"]
    try:
        procs.append(spawn_peer(["bootstrap", "--host", "127.0.0.1", "--port", "0", "--identity", str(root / "boot.key"),
                             "--run-dir", str(root / "boot")], log))
        addr = peer_ready(root / "boot", procs[-1], root)["addresses"][0]
        procs.append(spawn_peer(["learner", "--peers", addr, "--run-dir", str(root / "l0"), "--identity-dir", str(root / "l0-id"),
                             *args], log))
        owner = peer_ready(root / "l0", procs[-1], root)
        for i in range(samplers):
            procs.append(spawn_peer(["sampler", "--peers", addr, "--learner-key-file", str(root / "l0" / "learner.key"),
                                 "--prompts-per-round", "2", "--num-generations", "4", "--identity-dir", str(root / f"s{i}-id"),
                                 "--run-dir", str(root / f"s{i}")], log))
        for i in range(1, learners):
            cert = certify(root / f"l{i}-id", owner["owner_key_file"])
            procs.append(spawn_peer(["learner", "--peers", addr, "--run-dir", str(root / f"l{i}"), "--identity-dir",
                                 str(root / f"l{i}-id"), "--certificate", cert, *args], log))

        def rows(i):
            path = root / f"l{i}" / "steps.jsonl"
            return read_jsonl(path) if path.exists() else []

        deadline = time.time() + 400  # every learner stepping (together, when there are several)
        while time.time() < deadline and not all(
                any(r.get("learners", 1.0) == learners and r["groups"] > 0 for r in rows(i)) for i in range(learners)):
            dead = [p.args[3] for p in procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited; see {root / 'peers.log'}:\n{(root / 'peers.log').read_text()[-3000:]}")
            time.sleep(2)
        if time.time() >= deadline:
            raise RuntimeError(f"the learners did not all step within 400 s:\n{(root / 'peers.log').read_text()[-3000:]}")
        start = time.time()
        time.sleep(window_s)
        end = time.time()
        window = [r for i in range(learners) for r in rows(i) if start <= r["time"] <= end]
        owner_rows = [r for r in rows(0) if start <= r["time"] <= end]
        together = [r for r in owner_rows if r.get("learners", 1.0) >= 2]
        seconds = [r["seconds"] for r in owner_rows if r.get("seconds")]
        averaging = [r["averaging_seconds"] for r in together if "averaging_seconds" in r]
        params = None
        from swarm.model.loading import load_policy

        model, _ = load_policy("embedded")
        params = sum(p.numel() for p in model.parameters())
        return {"learners": learners, "samplers": samplers, "window_s": round(end - start, 1),
                "steps": len(owner_rows), "steps_per_min": round(60 * len(owner_rows) / (end - start), 2),
                "groups_per_s": round(sum(r["groups"] for r in window) / (end - start), 3),
                "step_s_mean": round(sum(seconds) / max(len(seconds), 1), 3),
                "averaging_s_mean": round(sum(averaging) / max(len(averaging), 1), 3) if averaging else 0.0,
                "steps_together": len(together), "params": params}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()


def certify(identity_dir: Path, owner_key_file: str) -> str:
    """A certificate from the run owner for the learner key in `identity_dir` (made there if new),
    through the CLI as a user would: `swarm learner-key`, then `swarm authorize`."""
    key = subprocess.run([*SWARM, "learner-key", "--identity-dir", str(identity_dir)], capture_output=True,
                         text=True, check=True).stdout.strip()
    return subprocess.run([*SWARM, "authorize", "--owner-key-file", owner_key_file, "--learner-key", key,
                           "--run-id", "swarm"], capture_output=True, text=True, check=True).stdout.strip()


def peer_ready(run_dir: Path, proc: subprocess.Popen, root: Path) -> dict:
    found = wait_ready(run_dir, timeout_s=240, alive=lambda: proc.poll() is None)
    if found is None:
        raise RuntimeError(f"{run_dir.name} did not start:\n{(root / 'peers.log').read_text()[-3000:]}")
    return found


def round_bytes(params: float, members: int) -> float:
    """Bytes one learner sends plus receives in a round of `members` (float64 fixed point)."""
    return 2 * 8 * params * (members - 1) / members


def run() -> None:
    window_s = float(os.environ.get("GEPO_LEARNERS_WINDOW_S", 120))
    samplers = int(os.environ.get("GEPO_LEARNERS_SAMPLERS", 4))
    results = []
    for learners in (1, 2):
        with tempfile.TemporaryDirectory(prefix=f"gepo-learners-{learners}-") as tmp:
            results.append(measure(learners, samplers, window_s, Path(tmp)))
            print(f"[learners] {results[-1]}", flush=True)
    one, two = results
    overhead = two["averaging_s_mean"] / two["step_s_mean"] if two["step_s_mean"] else float("nan")
    tiny_bytes = round_bytes(two["params"], 2)
    big_bytes = round_bytes(QWEN3_06B_PARAMS, 2)
    projection = {"params": QWEN3_06B_PARAMS, "bytes_per_round": big_bytes,
                  "seconds_at_1gbit": big_bytes / LINK_BYTES_PER_S}
    figures = {"runs": results, "averaging_share_of_step": overhead, "tiny_bytes_per_round": tiny_bytes,
               "qwen3_0_6b": projection}
    md = ["# Several learners: one against two on the same samplers", "",
          f"{samplers} samplers, loopback, 2 CPU cores shared by every process; {window_s:.0f} s measured per setting "
          "once the learners step (together). Global batch: 8 groups per step, split among the learners.", "",
          markdown_table(["learners", "steps/min", "groups/s", "step s (mean)", "averaging s (mean)", "steps together"],
                         [[r["learners"], r["steps_per_min"], r["groups_per_s"], r["step_s_mean"], r["averaging_s_mean"],
                           r["steps_together"]] for r in results]),
          f"Two learners against one: {two['groups_per_s'] / max(one['groups_per_s'], 1e-9):.2f}x the groups per second, "
          f"{two['steps_per_min'] / max(one['steps_per_min'], 1e-9):.2f}x the steps per minute.", "",
          f"Averaging takes {100 * overhead:.0f}% of a two-learner step here (matchmaking waits for the slower learner; "
          f"the tiny model's {two['params'] / 1e6:.2f}M parameters make {tiny_bytes / 1e6:.1f} MB per learner per round).", "",
          f"For a 0.6B-parameter model: {big_bytes / 1e9:.1f} GB sent plus received per learner per round (float64 fixed "
          f"point, 2 learners), {projection['seconds_at_1gbit']:.0f} s over a 1 Gbit/s link: worth it only where a "
          "step takes minutes (a large batch per learner), as in hivemind's own collaborative training.", ""]
    write_result("learners", figures, "\n".join(md))
