"""A whole swarm on this machine as separate processes on loopback: one bootstrap node, one
learner, N samplers, each a real `swarm` CLI process with its own log in `RUN_DIR/logs/` and its
own run directory. What the launcher needs from a peer (its addresses, the learner's key) it reads
from the ready.json the peer writes there, never from its printed output.

Process hygiene: every child gets its own session (so a Ctrl-C in the terminal reaches only the
launcher, which then stops the children in order: samplers, learner, bootstrap) and, on Linux, a
parent-death signal (so they also go if the launcher is killed outright). `stop()` sends SIGTERM,
waits, and kills what is left; it only ever signals the processes it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from swarm.config import SwarmSettings, default_of
from swarm.config.environment import without_settings
from swarm.runlog import wait_ready

SWARM = [sys.executable, "-m", "swarm.cli"]


# The launcher's pid, handed to each peer it starts: the peer asks Linux to SIGTERM it when the
# launcher dies. The peer does this itself at start-up (`die_with_launcher`) rather than in a Popen
# preexec_fn, because a preexec_fn makes Python fork instead of vfork: the child then runs the
# parent's fork handlers, and grpcio 1.80 and later abort such a child when the parent holds gRPC
# channels ("Epoll1Poller ... epoll_wait error: Bad file descriptor", grpc/grpc#43055), as a test
# process that has run gRPC peers does.
LAUNCHER_PID_ENV = "GEPO_SWARM_LAUNCHER_PID"


def die_with_launcher() -> None:
    """Peer-side, at start-up: SIGTERM this process when the launcher that started it dies."""
    launcher = os.environ.pop(LAUNCHER_PID_ENV, None)  # popped: the peer's own children are not tied to it
    if launcher is None or sys.platform != "linux":
        return  # started by hand, or not Linux: stop() still cleans up on a normal exit or Ctrl-C
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() != int(launcher):  # the launcher died before the line above: the signal never comes
        os.kill(os.getpid(), signal.SIGTERM)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path  # its printed output, for people
    run_dir: Path | None = None  # where it writes ready.json and its JSONL records
    ready: dict = field(default_factory=dict)  # its ready.json, once read

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout` seconds; the exit status."""
        stop_together([self], timeout)
        return self.popen.returncode

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


@dataclass
class LocalSwarm:
    run_dir: Path
    run_id: str = "demo"
    threads_per_peer: int = 1
    transport: str = default_of(SwarmSettings, "transport")
    procs: list[Proc] = field(default_factory=list)

    def spawn(self, name: str, *args: str, run_dir: Path | None = None) -> Proc:
        log = self.run_dir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        # the launcher resolved its settings with GEPO_SWARM_* already; its peers get theirs on their command line
        # and in config files, which those variables would override (a run directory shared by every peer)
        env = dict(without_settings(os.environ), PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(self.threads_per_peer),
                   MKL_NUM_THREADS=str(self.threads_per_peer), TOKENIZERS_PARALLELISM="false",
                   **{LAUNCHER_PID_ENV: str(os.getpid())})
        extra = ("--run-dir", str(run_dir)) if run_dir is not None else ()
        with log.open("w") as out:
            popen = subprocess.Popen([*SWARM, *args, *extra], stdout=out, stderr=subprocess.STDOUT, env=env, text=True,
                                     start_new_session=True)
        proc = Proc(name, popen, log, run_dir)
        self.procs.append(proc)
        return proc

    def wait_ready(self, proc: Proc, timeout: float = 120.0) -> dict:
        """The peer's ready.json; raises RuntimeError with the end of its log if it never comes."""
        found = wait_ready(proc.run_dir, timeout_s=timeout, alive=lambda: proc.popen.poll() is None, pid=proc.popen.pid)
        if found is None:
            raise RuntimeError(f"{proc.name} did not get ready (exit status {proc.popen.poll()}); "
                               f"its log {proc.log} ends with:\n{proc.text()[-2000:]}")
        proc.ready = found
        return found

    def start_bootstrap(self) -> str:
        """Start the bootstrap node; returns the address peers join through."""
        boot = self.spawn("bootstrap", "bootstrap", "--host", "127.0.0.1", "--port", "0", "--run-id", self.run_id,
                          "--identity", str(self.run_dir / "keys" / "bootstrap.p2p.key"), "--status-every-s", "10",
                          "--transport", self.transport, run_dir=self.run_dir / "bootstrap")
        return self.wait_ready(boot)["addresses"][0]

    @property
    def learner_identity_dir(self) -> Path:
        return self.run_dir / "keys" / "learner"

    def learner_key(self) -> str:
        """The key the learner of `spawn_learner` runs with, from its identity directory (the signing key made
        there now if it is new, as `swarm learner-key` does), so that samplers can start beside the learner
        rather than after it is ready. A learner takes that key while no other one runs from the directory
        (another would take its next slot, swarm.fabric.membership.identity): check its ready.json."""
        from swarm.config.learner_keys import encode_learner_key
        from swarm.fabric.membership.identity import first_learner_key_file, load_or_create_signing_key
        from swarm.fabric.signing import owner_key

        return encode_learner_key(owner_key(load_or_create_signing_key(first_learner_key_file(self.learner_identity_dir))))

    def spawn_learner(self, peers: str, *options: str, run_dir: Path | None = None) -> Proc:
        """Start a learner (run directory RUN_DIR/learner unless given), without waiting for it."""
        return self.spawn("learner", "learner", "--peers", peers, "--run-id", self.run_id,
                          "--identity-dir", str(self.learner_identity_dir), "--transport", self.transport,
                          *options, run_dir=run_dir or self.run_dir / "learner")

    def start_learner(self, peers: str, *options: str, run_dir: Path | None = None) -> tuple[Proc, str]:
        """Start a learner and wait until it is ready; returns it and its learner key."""
        learner = self.spawn_learner(peers, *options, run_dir=run_dir)
        return learner, self.wait_ready(learner)["learner_key"]

    def start_sampler(self, name: str, peers: str, learner_key: str, *options: str) -> Proc:
        """Start a sampler (run directory RUN_DIR/NAME); it is not waited for."""
        return self.spawn(name, "sampler", "--peers", peers, "--learner-key", learner_key, "--run-id", self.run_id,
                          "--sampler-id", name, "--identity-dir", str(self.run_dir / "keys" / name),
                          "--transport", self.transport, *options, run_dir=self.run_dir / name)

    def stop(self, proc: Proc, timeout: float = 30.0) -> int | None:
        return proc.stop(timeout)

    def stop_all(self, timeout: float = 30.0) -> None:
        stop_in_tiers(self.procs, timeout)


def stop_in_tiers(procs: list[Proc], timeout: float) -> None:
    """Samplers first (nothing more to send), then learners (they checkpoint), then the rest, each
    peer's tier read from its name ("learner", "learner-2", "bootstrap", "sampler-0"). The peers of
    one tier are signalled together and share one `timeout`, so stopping many samplers on a loaded
    machine takes one wait, not one per sampler."""
    tiers: dict[int, list[Proc]] = {}
    for proc in procs:
        tiers.setdefault({"learner": 1, "bootstrap": 2}.get(proc.name.split("-")[0], 0), []).append(proc)
    for _, tier in sorted(tiers.items()):
        stop_together(tier, timeout)


def stop_together(procs: list[Proc], timeout: float) -> None:
    """SIGTERM to each of `procs` still running, one shared wait of `timeout` seconds, then SIGKILL
    to what is left. A peer is its whole process group (each is spawned in its own session) and its
    descendants (its DHT process and p2p daemon, which leave the group so that a Ctrl-C reaches the
    peer alone): they exit after it, so they are waited for too, and killed if they outlive the wait."""
    import psutil

    running = [p for p in procs if p.popen.poll() is None]
    descendants = []
    for proc in running:
        try:
            descendants += [c for c in psutil.Process(proc.popen.pid).children(recursive=True) if not exits_by_itself(c)]
        except psutil.Error:
            pass
    for proc in running:
        proc.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in running:
        try:
            proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait(timeout=10)
    for proc in running:
        _stop_group(proc.popen.pid, deadline)
    _, left = psutil.wait_procs(descendants, timeout=max(0.0, deadline - time.monotonic()))
    _kill_all(left)


# torch's shared-memory manager, started by every process that shares a tensor under the "file_system"
# strategy (hivemind sets it, and its MPFuture shares a byte buffer, so every peer with a DHT has one).
# It exits by itself 2 s after its last client is gone (libshm's SHUTDOWN_TIMEOUT), and only then
# unlinks the shared memory it tracks: killing it would leave that memory in /dev/shm, and waiting for
# it cost every stop 2 s.
TORCH_SHM_MANAGER = "torch_shm_manager"


def exits_by_itself(process) -> bool:
    import psutil

    try:
        return process.name() == TORCH_SHM_MANAGER
    except psutil.Error:
        return False


def _stop_group(pgid: int, deadline: float) -> None:
    """Wait until `deadline` for the live members of process group `pgid` to exit, then SIGKILL them."""
    import psutil

    def members() -> list:
        found = []
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except (OSError, psutil.Error):
                pass
        return found

    left = members()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = members()
    _kill_all(left)


def _kill_all(processes: list) -> None:
    """SIGKILL what is still alive of `processes` (psutil.Process), and reap it."""
    import psutil

    for p in processes:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(processes, timeout=5)
