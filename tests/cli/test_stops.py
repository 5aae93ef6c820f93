"""Every stop clean (issue 47): Ctrl-C, sent to the whole process group as a terminal sends it, ends
each long-running command with one line, no traceback from it or any of its children, and exit
status 130; a learner that trains its last step ends without a traceback and its samplers leave
(exit 0) on its signed word; a taken port is refused at once, naming its option. Real `swarm`
processes on 127.0.0.1, one bootstrap node shared by the tests that need one."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from swarm.runlog import read_jsonl, wait_ready
from tests.helpers.processes import kill_tree

SWARM = [sys.executable, "-m", "swarm.cli"]
ENV = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")


class Started:
    """A `swarm` command in its own session (as a terminal's foreground job is its own process
    group), its output in files; only what the test started is ever signalled or killed."""

    def __init__(self, tmp_path, name: str, *args: str, sigint_ignored: bool = False) -> None:
        self.out, self.err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        # sigint_ignored: started as `&` in a script or nohup starts it, SIGINT ignored (Python keeps it so)
        ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
        with self.out.open("w") as out, self.err.open("w") as err:
            self.popen = subprocess.Popen([*SWARM, *args], stdout=out, stderr=err, env=ENV, start_new_session=True,
                                          preexec_fn=ignore)

    def ctrl_c(self, timeout: float = 150) -> int:
        """SIGINT to the whole process group (the peer, its DHT process, p2pd, its reward worker); a peer
        leaves its DHT in order, which took over a minute on a loaded 2-core machine."""
        os.killpg(self.popen.pid, signal.SIGINT)
        return self.popen.wait(timeout=timeout)

    def text(self) -> str:
        return self.out.read_text() + "\n--- stderr\n" + self.err.read_text()

    def kill(self) -> None:
        if self.popen.poll() is None:
            kill_tree(self.popen.pid)


def wait_for(condition, timeout: float, what: str, proc: Started | None = None) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert proc is None or proc.popen.poll() is None, f"{what}: exited with {proc.popen.returncode}\n{proc.text()[-3000:]}"
        assert time.time() < deadline, f"no {what} within {timeout:.0f}s" + (f"\n{proc.text()[-3000:]}" if proc else "")
        time.sleep(0.2)


def assert_clean_ctrl_c(proc: Started, status: int) -> None:
    text = proc.text()
    assert status == 130, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert proc.err.read_text().rstrip().endswith("stopped by Ctrl-C"), text[-3000:]


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory):
    """One hivemind bootstrap node on a fixed port of loopback: (its address, its port)."""
    tmp = tmp_path_factory.mktemp("boot")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = Started(tmp, "bootstrap", "bootstrap", "--host", "127.0.0.1", "--port", str(port), "--identity",
                   str(tmp / "boot.key"), "--run-dir", str(tmp / "run"), "--status-every-s", "60")
    try:
        ready = wait_ready(tmp / "run", timeout_s=120, alive=lambda: node.popen.poll() is None)
        assert ready is not None, node.text()[-3000:]
        yield ready["addresses"][0], port
    finally:
        node.kill()


# -- taken ports


@contextlib.contextmanager
def learner_and_sampler(bootstrap, tmp_path, *, steps: int):
    """A learner of `steps` steps, then (once it is ready) one sampler following its key; both killed
    on the way out, whatever the test did to them."""
    addr, _ = bootstrap
    learner = Started(tmp_path, "learner", "learner", "--peers", addr, "--host", "127.0.0.1", "--steps", str(steps),
                      "--groups-per-step", "1", "--checkpoint-every", "0", "--max-completion-length", "8",
                      "--run-dir", str(tmp_path / "learner"), "--identity-dir", str(tmp_path / "learner-id"))
    sampler = None
    try:
        ready = wait_ready(tmp_path / "learner", timeout_s=120, alive=lambda: learner.popen.poll() is None)
        assert ready is not None, learner.text()[-3000:]
        sampler = Started(tmp_path, "sampler", "sampler", "--peers", addr, "--host", "127.0.0.1", "--learner-key",
                          ready["learner_key"], "--prompts-per-round", "1", "--num-generations", "2",
                          "--run-dir", str(tmp_path / "sampler"), "--identity-dir", str(tmp_path / "sampler-id"))
        yield learner, sampler
    finally:
        learner.kill()
        if sampler is not None:
            sampler.kill()


def test_a_taken_port_is_refused_at_once_naming_its_option(bootstrap, tmp_path):
    addr, port = bootstrap
    key = "W293bmVyOm5vdC1hLXJlYWwta2V5XQ=="  # well-formed; never used: the port check comes first
    cases = [
        # a second bootstrap node on the port of the first started beside it (p2pd listens with SO_REUSEPORT)
        (["bootstrap", "--host", "127.0.0.1", "--port", str(port), "--identity", str(tmp_path / "b.key")], "--port"),
        (["bootstrap", "--transport", "grpc", "--host", "127.0.0.1", "--port", str(port), "--insecure"], "--port"),
        (["bootstrap", "--host", "127.0.0.1", "--port", "0", "--dashboard-port", str(port)], "--dashboard-port"),
        (["learner", "--peers", addr, "--host", "127.0.0.1", "--port", str(port)], "--port"),
        (["learner", "--peers", addr, "--dashboard-port", str(port)], "--dashboard-port"),
        (["sampler", "--peers", addr, "--learner-key", key, "--host", "127.0.0.1", "--port", str(port)], "--port"),
        (["sampler", "--peers", addr, "--learner-key", key, "--dashboard-port", str(port)], "--dashboard-port"),
        (["dashboard", "--peers", addr, "--port", str(port)], "--port"),
    ]
    for args, option in cases:
        started = time.monotonic()
        out = subprocess.run([*SWARM, *args, "--run-dir", str(tmp_path / "never")] if args[0] != "dashboard" else
                             [*SWARM, *args], capture_output=True, text=True, env=ENV, timeout=60)
        said = " ".join(out.stderr.split())
        assert out.returncode == 1, (args, out.stderr[-2000:])
        assert f"{option} {port}: the port is taken on 127.0.0.1" in said and f"choose another {option}" in said, (args, said)
        assert "Traceback" not in out.stderr
        assert time.monotonic() - started < 20, (args, "not at once")  # no join attempt: a second or two of imports
        assert not (tmp_path / "never").exists()


# -- Ctrl-C


def test_ctrl_c_stops_a_learner_and_a_sampler_with_status_130_and_nothing_lost(bootstrap, tmp_path):
    with learner_and_sampler(bootstrap, tmp_path, steps=1000) as (learner, sampler):
        steps = tmp_path / "learner" / "steps.jsonl"
        wait_for(lambda: steps.exists() and len(read_jsonl(steps)) >= 2, 120, "two learner steps", learner)

        status = learner.ctrl_c()
        assert_clean_ctrl_c(learner, status)
        records = steps.read_text().splitlines()
        version = int(json.loads(records[-1])["version"])  # every line whole
        assert [int(json.loads(line)["version"]) for line in records] == list(range(1, version + 1))
        saved = [e for e in read_jsonl(tmp_path / "learner" / "events.jsonl") if e["event"] == "checkpoint"]
        assert saved and saved[-1]["version"] == version  # the last version trained was saved on the way out
        assert (tmp_path / "learner" / "checkpoints" / f"version-{version:06d}").is_dir()
        assert "learner stopped at version" in learner.out.read_text()

        # the sampler, its reward worker scoring (a KeyboardInterrupt traceback came from it), the learner gone
        status = sampler.ctrl_c()
        assert_clean_ctrl_c(sampler, status)
        assert read_jsonl(tmp_path / "sampler" / "events.jsonl")[-1]["event"] == "stopped"
        assert "run_ended" not in sampler.out.read_text()  # a Ctrl-C'd learner has not ended the run


def test_a_learners_last_step_ends_the_run_for_its_samplers(bootstrap, tmp_path):
    """The learner trains its last step and announces the end (signed); the sampler says so in one
    line and exits 0. Neither prints a traceback."""
    with learner_and_sampler(bootstrap, tmp_path, steps=2) as (learner, sampler):
        assert learner.popen.wait(timeout=180) == 0, learner.text()[-3000:]
        assert sampler.popen.wait(timeout=60) == 0, sampler.text()[-3000:]
        assert "Traceback" not in learner.text() and "Traceback" not in sampler.text(), learner.text() + sampler.text()
        assert "run ended at version 2: announced to the samplers" in learner.out.read_text()
        assert "the learner ended the run at version 2; stopping" in sampler.out.read_text(), sampler.text()[-3000:]
        # a round or two in flight when the learner left may be refused before the sampler reads the end (the
        # learner's last announcement before it stops): no retrying on and on
        assert sampler.out.read_text().count("retrying") <= 5, sampler.text()[-3000:]
        events = read_jsonl(tmp_path / "sampler" / "events.jsonl")
        assert [e["event"] for e in events[-2:]] == ["run_ended", "stopped"] and events[-1]["run_ended_at"] == 2


def test_ctrl_c_stops_a_bootstrap_node_status_watch_and_a_dashboard(tmp_path):
    node = Started(tmp_path, "bootstrap", "bootstrap", "--host", "127.0.0.1", "--port", "0", "--identity",
                   str(tmp_path / "boot.key"), "--run-dir", str(tmp_path / "run"))
    watching = dashboard = None
    try:
        ready = wait_ready(tmp_path / "run", timeout_s=120, alive=lambda: node.popen.poll() is None)
        assert ready is not None, node.text()[-3000:]
        addr = ready["addresses"][0]
        # off a terminal, the table is printed whole (rich squeezed it into 80 columns: "stalen…")
        table = subprocess.run([*SWARM, "status", "--peers", addr], capture_output=True, text=True, env=ENV, timeout=120)
        assert table.returncode == 0, table.stderr[-2000:]
        assert "staleness" in table.stdout and "last heartbeat" in table.stdout and "…" not in table.stdout, table.stdout
        assert f"more: swarm status --peers {addr} --run-id swarm --watch 5" in table.stdout  # the command whole, on one line

        watching = Started(tmp_path, "status", "status", "--peers", addr, "--watch", "1")
        dashboard = Started(tmp_path, "dashboard", "dashboard", "--peers", addr, "--port", "0")
        wait_for(lambda: "learner version" in watching.out.read_text(), 120, "status table", watching)
        wait_for(lambda: "dashboard of run" in dashboard.out.read_text(), 120, "dashboard", dashboard)
        for proc in (watching, dashboard, node):
            assert_clean_ctrl_c(proc, proc.ctrl_c())
    finally:
        for proc in (node, watching, dashboard):
            if proc is not None:
                proc.kill()


def test_ctrl_c_stops_swarm_eval_while_it_scores(tmp_path):
    """Started with SIGINT ignored, as the suite itself was once (nohup): eval then scored to the end
    and exited 0; it sets its own handler now."""
    evaluation = Started(tmp_path, "eval", "eval", "--eval-problems", "500", "--eval-samples", "16", "--no-greedy",
                         sigint_ignored=True)
    try:
        # scoring under way: its progress line counts scored problems (the reward worker, a process of
        # its own in the same process group, has scored some)
        wait_for(lambda: "/500 problems" in evaluation.err.read_text(), 240, "scoring progress", evaluation)
        time.sleep(1)
        assert_clean_ctrl_c(evaluation, evaluation.ctrl_c())
    finally:
        evaluation.kill()
