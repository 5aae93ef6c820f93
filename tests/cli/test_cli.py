"""The `swarm` command: fast help without torch, eval end to end, usage errors with exit 2."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from swarm.runlog import read_jsonl

SWARM = [sys.executable, "-m", "swarm.cli"]


def run(*args, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([*SWARM, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_help_is_fast_and_imports_no_torch():
    code = (
        "import sys, time; t = time.time();"
        "from click.testing import CliRunner; from swarm.cli import main;"
        "r = CliRunner().invoke(main, ['--help']); assert r.exit_code == 0, r.output;"
        "assert 'eval' in r.output;"
        "heavy = [m for m in ('torch', 'transformers', 'hivemind', 'datasets') if m in sys.modules];"
        "assert not heavy, heavy; print(time.time() - t)"
    )
    started = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert time.time() - started < 5  # generous for a loaded CI machine; typically ~0.2 s


def test_status_and_dashboard_say_nothing_listens_at_peers_before_importing_torch():
    """A wrong --peers (nothing listens there) is said in a moment: no torch, transformers or
    hivemind import first (3.7 s here before)."""
    dead = "/ip4/127.0.0.1/tcp/9/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ"
    code = (
        "import sys; from click.testing import CliRunner; from swarm.cli import main;"
        f"runs = [CliRunner().invoke(main, args) for args in (['status', '--peers', {dead!r}], ['dashboard', '--peers', {dead!r}],"
        "         ['status', '--transport', 'grpc', '--peers', '127.0.0.1:9'])];"
        "assert all(r.exit_code == 1 and 'could not join the swarm through' in r.output"
        "           and 'connection refused' in r.output for r in runs), [(r.exit_code, r.output) for r in runs];"
        "heavy = [m for m in ('torch', 'transformers', 'hivemind') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]


def test_eval_embedded_default_json():
    out = run("eval", "--eval-problems", "20", "--eval-samples", "2", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["num_problems"] == 20 and result["samples_per_problem"] == 2
    assert 0.0 <= result["pass_at_1"] <= 1.0 and 0.0 <= result["greedy_accuracy"] <= 1.0
    assert result["completion_tokens"] > 0
    # the warm start leaves room for RL: right some of the time, not always
    assert 0.0 < result["pass_at_1"] < 0.9


def test_eval_table_on_a_local_dataset(tmp_path):
    path = tmp_path / "sums.jsonl"
    path.write_text("\n".join(json.dumps({"q": f"Compute {i}+1. Answer in \\boxed{{}}.\n", "a": str(i + 1)}) for i in range(30)))
    out = run("eval", "--task", str(path), "--question-column", "q", "--answer-column", "a", "--split", "train",
              "--limit", "5", "--samples", "1", "--no-greedy")
    assert out.returncode == 0, out.stderr
    # the title names the file; a path longer than the console wraps, so it is looked for without line breaks
    assert "pass@1" in out.stdout and "/sums.jsonl(train)" in "".join(out.stdout.split())
    # the train split of a single file is its rows less the 10% hold-out (here 1 row); --limit takes 5 of them
    assert "evaluating 5 of 29 problems (sums's rows less their 10% hold-out)" in out.stderr
    assert "5 of 29" in out.stdout


def test_eval_reads_every_row_of_a_gsm8k_style_file_and_says_so():
    gsm = Path(__file__).parents[1] / "data" / "gsm8k_style.jsonl"
    out = run("eval", "--task", str(gsm), "--answer-pattern", r"####\s*(.+)", "--stop", "\nQuestion:", "--samples", "1",
              "--no-greedy", "--max-completion-length", "4", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert (result["split"], result["num_problems"], result["problems_in_split"], result["rows_skipped"]) == ("all", 9, 9, 1)
    assert ("evaluating 9 of 9 problems (every row of gsm8k_style); 1 rows without a question or a gold answer "
            "(see --answer-pattern) left out") in out.stderr


def test_eval_of_a_hub_model_fails_at_once_without_the_hub(tmp_path):
    env = dict(os.environ, HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path), HF_HUB_OFFLINE="0")
    started = time.time()
    out = subprocess.run([*SWARM, "eval", "--model", "someone/some-model"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "model 'someone/some-model' is not a local directory and the Hugging Face hub cannot be reached" in out.stderr
    assert time.time() - started < 30  # the interpreter and torch starting; transformers' retries took ~50 s


@pytest.mark.parametrize(
    "args, message",
    [
        (["eval", "--task", "nope.jsonl"], "nope.jsonl does not exist"),
        (["eval", "--model", "./missing-model"], "missing-model does not exist"),
        (["eval", "--model", "~no-such-user-gepo/model"], "~no-such-user-gepo names no user here"),
        (["eval", "--task", "gsm8k"], "unknown task 'gsm8k'"),
        # the task is checked before the model is looked for (and loaded: seconds of imports and weights)
        (["eval", "--task", "gsm8k", "--model", "./missing-model"], "unknown task 'gsm8k'"),
        (["eval", "--samples", "0"], "--eval-samples: Input should be greater than or equal to 1"),
        (["eval", "--backend", "tgi"], "Invalid value for '--backend'"),
        (["eval", "--task", "x.jsonl", "--answer-pattern", "####(.+"], "--answer-pattern: '####(.+' is not a regular expression"),
        (["eval", "--answer-pattern", "####(.+)"], "--answer-pattern applies to dataset tasks"),
        (["eval", "--task", "x.jsonl", "--prompt-template", "Q:"], "--prompt-template: 'Q:' has no {question}"),
        (["eval", "--split", "dev"], "Invalid value for '--split'"),
    ],
)
def test_bad_input_names_itself_and_exits_2(args, message):
    out = run(*args, timeout=120)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def peer_processes_of(run_dir) -> list:
    """Processes whose command line names `run_dir` (the demo's peers all do)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(str(run_dir) in part for part in proc.info["cmdline"] or ()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def end_demo(demo: subprocess.Popen, run_dir) -> None:
    """On a test's failure, the demo and the peers it started (by their command lines naming `run_dir`)."""
    if demo.poll() is None:
        demo.kill()
        demo.wait(timeout=30)
    for proc in peer_processes_of(run_dir):
        proc.kill()


def test_swarm_demo_trains_a_real_local_swarm(tmp_path):
    run_dir = tmp_path / "demo"
    out = run("demo", "--steps", "2", "--groups-per-step", "4", "--num-generations", "4", "--eval-problems", "8",
              "--report-to", "tensorboard", "--run-dir", str(run_dir), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "before" in out.stdout and "after" in out.stdout and "version 0 -> 2" in out.stdout
    steps = [json.loads(line) for line in (run_dir / "learner" / "steps.jsonl").read_text().splitlines()]
    assert [int(s["version"]) for s in steps] == [1, 2]
    assert {p.name for p in (run_dir / "logs").iterdir()} == {"bootstrap.log", "learner.log", "sampler-0.log", "sampler-1.log"}
    # every peer got the demo's settings through swarm.yaml
    learner_config = yaml.safe_load((run_dir / "learner" / "config.yaml").read_text())
    assert (learner_config["steps"], learner_config["groups_per_step"]) == (2, 4)
    sampler_config = yaml.safe_load((run_dir / "sampler-0" / "config.yaml").read_text())
    assert sampler_config["num_generations"] == 4
    sent = [e for e in read_jsonl(run_dir / "sampler-0" / "events.jsonl") if e["event"] == "sent"]
    assert sent and {e["groups"] for e in sent} == {sampler_config["prompts_per_round"]}
    # --report-to reached every peer: each wrote TensorBoard event files beside its JSONL
    assert learner_config["report_to"] == sampler_config["report_to"] == ["tensorboard"]
    for peer in ("learner", "sampler-0", "sampler-1"):
        assert list((run_dir / peer / "tensorboard").glob("events.out.tfevents.*")), peer
    # the final checkpoint is the policy the "after" column measured: evaluating it again gives the same numbers
    final = run_dir / "learner" / "checkpoints" / "version-000002"
    evals = json.loads((run_dir / "evals.json").read_text())
    assert [e["step"] for e in evals] == [0, 2]
    # with the demo's settings: a checkpoint directory is evaluated as a real model (1,024 new tokens by
    # default), and the rows a generate call holds (its token budget), so its samples, follow that length
    again = run("eval", "--model", str(final), "--eval-problems", "8", "--max-completion-length",
                str(learner_config["max_completion_length"]), "--json")
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout)["pass_at_1"] == evals[1]["pass_at_1"]
    assert (run_dir / "training.png").stat().st_size > 10_000
    assert peer_processes_of(run_dir) == []  # nothing left behind


def test_swarm_demo_ctrl_c_stops_every_process(tmp_path):
    import signal

    run_dir = tmp_path / "demo"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # started with SIGINT ignored, as a job started with `&` by a script or under nohup is: the demo
    # must still stop on it. The shell ignores it and execs the demo (an ignored signal stays ignored
    # across exec); a preexec_fn would fork this test process, which may hold gRPC channels, and
    # grpcio aborts such children (see swarm/cli/launcher.py)
    demo = subprocess.Popen(["sh", "-c", 'trap "" INT; exec "$@"', "sh", *SWARM, "demo", "--steps", "1000",
                             "--groups-per-step", "2", "--num-generations", "2", "--eval-problems", "2",
                             "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    steps = run_dir / "learner" / "steps.jsonl"
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not (steps.exists() and steps.read_text().count("\n") >= 2) and demo.poll() is None:
            time.sleep(0.5)
        assert demo.poll() is None, demo.stderr.read()[-3000:]
        assert len(peer_processes_of(run_dir)) >= 4
        demo.send_signal(signal.SIGINT)
        out, err = demo.communicate(timeout=240)
        # stopped, then what the learner trained evaluated all the same (README: "evaluates after Ctrl-C"); Ctrl-C's status
        assert demo.returncode == 130 and err.rstrip().endswith("stopped by Ctrl-C"), err[-3000:]
        assert "Traceback" not in err and "held-out accuracy" in out, out[-2000:] + err[-3000:]
        assert peer_processes_of(run_dir) == []
        saved = list((run_dir / "learner" / "checkpoints").glob("version-*"))  # the learner saved on its way out
        assert saved
        evals = json.loads((run_dir / "evals.json").read_text())
        assert [e["step"] for e in evals] == [0, int(max(saved).name.split("-")[1])]
    finally:
        end_demo(demo, run_dir)


def demo_peers(run_dir, demo_pid: int) -> set[str]:
    """The demo's peers running now, by role: "bootstrap", "learner", "sampler-0", ... (not the demo
    itself, nor the peers' DHT processes, whose command lines are their peers')."""
    import psutil

    roles = set()
    for proc in peer_processes_of(run_dir):
        try:
            if proc.ppid() != demo_pid:  # the demo itself, or a peer's DHT process
                continue
            cmd = proc.cmdline()
        except psutil.Error:
            continue
        role = cmd[cmd.index("swarm.cli") + 1] if "swarm.cli" in cmd else ""
        roles.add(cmd[cmd.index("--sampler-id") + 1] if "--sampler-id" in cmd else role)
    return roles


def test_swarm_demo_ctrl_c_while_its_peers_start_stops_them_all(tmp_path):
    """The demo starts its learner and samplers together, the samplers before the learner is ready: a
    Ctrl-C while they start (half-imported, or joining) still stops every peer, with Ctrl-C's status and
    no traceback."""
    import signal

    run_dir = tmp_path / "demo"
    demo = subprocess.Popen([*SWARM, "demo", "--steps", "1000", "--eval-problems", "2", "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    everyone = {"bootstrap", "learner", "sampler-0", "sampler-1"}
    try:
        deadline = time.time() + 120
        while time.time() < deadline and demo_peers(run_dir, demo.pid) != everyone and demo.poll() is None:
            time.sleep(0.1)
        assert demo.poll() is None, demo.stderr.read()[-3000:]
        assert demo_peers(run_dir, demo.pid) == everyone and not (run_dir / "evals.json").exists()
        demo.send_signal(signal.SIGINT)
        out, err = demo.communicate(timeout=180)
        assert demo.returncode == 130 and err.rstrip().endswith("stopped by Ctrl-C"), err[-3000:]
        assert "Traceback" not in err, err[-5000:]
        assert "nothing to evaluate" in err or "held-out accuracy" in out, out[-2000:] + err[-3000:]
        assert peer_processes_of(run_dir) == []
    finally:
        end_demo(demo, run_dir)


def test_peers_started_by_a_launcher_end_when_it_is_killed(tmp_path):
    """A launcher (here a script using LocalSwarm, as `swarm demo` does) SIGKILLed: its bootstrap
    node, which it started, is told to stop by Linux and leaves no process behind."""
    import psutil

    script = ("import sys, time; from pathlib import Path; from swarm.cli.launcher import LocalSwarm;"
              "swarm = LocalSwarm(Path(sys.argv[1])); print(swarm.start_bootstrap(), flush=True); time.sleep(600)")
    launcher = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout.readline().startswith("/ip4/127.0.0.1/")  # the bootstrap is up
        started = peer_processes_of(tmp_path)
        assert any(p.ppid() == launcher.pid for p in started)  # the bootstrap, the launcher's child
        launcher.kill()
        launcher.wait(timeout=30)
        _, alive = psutil.wait_procs(started, timeout=60)
        assert alive == [], [p.cmdline() for p in alive]
    finally:  # on failure, what this test started
        if launcher.poll() is None:
            launcher.kill()
        for proc in peer_processes_of(tmp_path):
            proc.kill()


def test_a_stopped_peer_leaves_torchs_shared_memory_manager_to_clean_up_and_exit(tmp_path):
    """The launcher stops a peer without waiting for torch's shared-memory manager, which exits by itself
    2 s after its last client and only then unlinks the shared memory it tracks: it is not killed (the
    peer's shared memory would stay in /dev/shm), and it does exit."""
    import psutil

    from swarm.cli.launcher import LocalSwarm, exits_by_itself
    from tests.helpers.processes import kill_started

    swarm = LocalSwarm(tmp_path)
    try:
        swarm.start_bootstrap()
        tree = psutil.Process(swarm.procs[0].popen.pid).children(recursive=True)
        managers = [p for p in tree if exits_by_itself(p)]
        pids = [swarm.procs[0].popen.pid, *(p.pid for p in tree)]

        def shared_memory() -> list[str]:
            return [f for f in os.listdir("/dev/shm") if any(f.startswith(f"torch_{pid}_") for pid in pids)]

        assert len(managers) == 1 and shared_memory()  # hivemind's sharing strategy: one manager, a shared buffer
        swarm.stop_all()
        others = [p for p in tree if p not in managers]
        assert not [p for p in others if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        _, alive = psutil.wait_procs(managers, timeout=30)
        assert not alive and shared_memory() == []
    finally:
        kill_started(swarm)


def test_in_process_demo_trains_and_writes_its_run_directory(tmp_path):
    run_dir = tmp_path / "demo"
    out = run("demo", "--in-process", "--steps", "2", "--groups-per-step", "4", "--num-generations", "2", "--delay", "fixed:1",
              "--eval-problems", "8", "--run-dir", str(run_dir))
    assert out.returncode == 0, out.stderr
    assert "before" in out.stdout and "after" in out.stdout and str(run_dir) in out.stdout
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(s["learning_rate"] > 0 for s in steps)
    assert steps[1]["staleness_max"] == 1.0  # the second step trained on version-0 rollouts
    evals = json.loads((run_dir / "evals.json").read_text())
    assert [e["step"] for e in evals] == [0, 2]
    assert (run_dir / "training.png").stat().st_size > 10_000
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["loss"]["name"] == "topr"


@pytest.mark.parametrize(
    "args, message",
    [
        (["demo", "--loss", "ppo"], "'ppo' is not one of 'gepo', 'grpo'"),
        (["demo", "--delay", "poisson:3"], "bad delay distribution 'poisson:3'"),
        (["demo", "--steps", "0"], "--steps: Input should be greater than or equal to 1"),
        (["demo", "--pickup-delay", "lognormal:5"], "bad pickup delay 'lognormal:5'"),
        (["learner", "--peers", "/ip4/127.0.0.1/tcp/9/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ", "--learning-rate", "0"],
         "--learning-rate: Input should be greater than 0"),
        (["sampler", "--transport", "carrier-pigeon"], "Invalid value for '--transport'"),
        (["bootstrap", "--transport", "grpc", "--peers", "/ip4/127.0.0.1/tcp/9"], "a gRPC registry joins no other peers"),
        (["learner", "--config", "missing.toml"], "config file missing.toml does not exist"),
    ],
)
def test_usage_errors_name_themselves_and_exit_2(args, message):
    out = run(*args, timeout=120)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
