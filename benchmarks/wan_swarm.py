"""A swarm of real `swarm` CLI processes spread over the hosts of a `benchmarks.wan.Wan`: each
"machine" (namespace) gets its own working directory and its own key cache, as separate machines
would, and every peer its own log. What a peer reports is read from the ready.json and JSONL
records it writes, never from its printed output. Used by tests/wan/test_wan.py and the fan-out
benchmark.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from benchmarks.waiting import wait_until
from benchmarks.wan import Host, Wan
from swarm.cli.launcher import Proc, stop_in_tiers
from swarm.runlog import read_jsonl, read_ready, wait_ready

SWARM = [sys.executable, "-m", "swarm.cli"]
REPO = Path(__file__).resolve().parents[1]


class WanSwarm:
    def __init__(self, wan: Wan, root: Path, *, threads_per_peer: int = 1) -> None:
        self.wan, self.root, self.threads_per_peer = wan, Path(root), threads_per_peer
        self.procs: list[Proc] = []

    def home(self, host: Host) -> Path:
        """The host's working directory (relative run directories land here) and key cache."""
        path = self.root / host.name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def spawn(self, host: Host, name: str, argv: list[str], *, run_dir: Path | None = None,
              program: list[str] = SWARM) -> Proc:
        """Run `argv` (a `swarm` command line after `swarm`, or the arguments of `program`) on
        `host`, in its working directory; its output goes to ROOT/logs/NAME.log."""
        log = self.root / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        home = self.home(host)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(self.threads_per_peer),
                   MKL_NUM_THREADS=str(self.threads_per_peer), TOKENIZERS_PARALLELISM="false",
                   GEPO_SWARM_CACHE=str(home / "cache"),  # each machine its own identity keys
                   # the checkout's benchmarks and tests packages, from the host's own working directory
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        with log.open("a") as out:
            popen = host.popen([*program, *argv], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=home)
        proc = Proc(name, popen, log, Path(home, run_dir) if run_dir is not None else None)
        proc.host = host.name
        self.procs.append(proc)
        return proc

    def ready(self, proc: Proc, timeout: float = 120.0) -> dict:
        """The peer's ready.json. A peer started without --run-dir writes it in a run directory it
        names itself (runs/ROLE-TIME under its host's working directory): that one is found by pid."""
        deadline = time.time() + timeout
        while proc.run_dir is None and time.time() < deadline and proc.popen.poll() is None:
            home = self.root / proc.host
            for candidate in sorted(home.glob("runs/*/ready.json")):
                found = read_ready(candidate.parent)
                if found is not None and found.get("pid") == proc.popen.pid:
                    proc.run_dir = candidate.parent
            time.sleep(0.2)
        found = proc.run_dir and wait_ready(proc.run_dir, timeout_s=max(deadline - time.time(), 0),
                                            alive=lambda: proc.popen.poll() is None, pid=proc.popen.pid)
        if not found:
            raise RuntimeError(f"{proc.name} did not get ready (exit status {proc.popen.poll()}); its log ends with:\n"
                               f"{proc.text()[-3000:]}")
        proc.ready = found
        return found

    def stop_all(self, timeout: float = 30.0) -> None:
        stop_in_tiers(self.procs, timeout)

    def processes(self) -> str:
        """Every process still in the harness's namespaces, for a failure message."""
        lines = []
        for host in self.wan.hosts():
            for pid in pids_in(host):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
                except OSError:
                    cmd = "?"
                lines.append(f"{host.name} {pid}: {cmd}")
        return "processes left:\n" + "\n".join(lines)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} (exit {p.popen.poll()}):\n{p.text()[-2500:]}" for p in self.procs)


def pids_in(host: Host) -> list[int]:
    """The processes running in `host`'s namespace (asked from outside it: a probe run inside would count itself)."""
    done = subprocess.run(["ip", "netns", "pids", host.ns], capture_output=True, text=True, timeout=10)
    return [int(p) for p in done.stdout.split()]


def records(run_dir: Path, name: str = "events.jsonl") -> list[dict]:
    return read_jsonl(Path(run_dir) / name)


def wait_for(condition: Callable[[], bool], timeout: float, what: str, swarm: WanSwarm | None = None,
             poll_s: float = 0.5) -> None:
    """wait_until, with `swarm`'s peer logs and leftover processes in the message when time runs out."""
    wait_until(condition, timeout, what, every=poll_s,
               logs=(lambda: f"{swarm.logs()}\n{swarm.processes()}") if swarm is not None else None)
