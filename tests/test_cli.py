"""The `swarm` command: fast help without torch, eval end to end, clear errors with exit 1."""

import json
import os
import subprocess
import sys
import time

import pytest

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


def test_eval_embedded_default_json():
    out = run("eval", "--limit", "20", "-k", "2", "--json")
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
              "--limit", "5", "-k", "1", "--no-greedy")
    assert out.returncode == 0, out.stderr
    assert "pass@1" in out.stdout and "sums" in out.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["eval", "--task", "nope.jsonl"], "nope.jsonl does not exist"),
        (["eval", "--model", "./missing-model"], "missing-model does not exist"),
        (["eval", "--task", "gsm8k"], "unknown task 'gsm8k'"),
        (["eval", "--samples", "0"], "Invalid value for '-k' / '--samples'"),
        (["eval", "--backend", "tgi"], "Invalid value for '--backend'"),
    ],
)
def test_bad_input_names_itself_and_exits_nonzero(args, message):
    out = run(*args, timeout=120)
    assert out.returncode != 0
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


def test_swarm_demo_trains_a_real_local_swarm(tmp_path):
    run_dir = tmp_path / "demo"
    out = run("demo", "--steps", "3", "--prompts-per-step", "4", "--group-size", "4", "--run-dir", str(run_dir), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "before" in out.stdout and "after" in out.stdout and "version 0 -> 3" in out.stdout
    steps = [json.loads(line) for line in (run_dir / "learner" / "steps.jsonl").read_text().splitlines()]
    assert [int(s["version"]) for s in steps] == [1, 2, 3]
    assert {p.name for p in (run_dir / "logs").iterdir()} == {"bootstrap.log", "learner.log", "sampler-0.log", "sampler-1.log"}
    final = run_dir / "learner" / "checkpoints" / "version-000003"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoModelForCausalLM.from_pretrained(final) is not None and AutoTokenizer.from_pretrained(final) is not None
    evals = json.loads((run_dir / "evals.json").read_text())
    assert [e["step"] for e in evals] == [0, 3]
    assert (run_dir / "training.png").stat().st_size > 10_000
    assert peer_processes_of(run_dir) == []  # nothing left behind


def test_swarm_demo_ctrl_c_stops_every_process(tmp_path):
    import signal

    run_dir = tmp_path / "demo"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    demo = subprocess.Popen([*SWARM, "demo", "--steps", "1000", "--prompts-per-step", "2", "--group-size", "2", "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    steps = run_dir / "learner" / "steps.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (steps.exists() and steps.read_text().count("\n") >= 2) and demo.poll() is None:
        time.sleep(0.5)
    assert demo.poll() is None, demo.stderr.read()[-3000:]
    assert len(peer_processes_of(run_dir)) >= 4
    demo.send_signal(signal.SIGINT)
    _, err = demo.communicate(timeout=120)
    assert demo.returncode == 1 and "interrupted; all demo processes were stopped" in err, err[-3000:]
    assert peer_processes_of(run_dir) == []
    assert list((run_dir / "learner" / "checkpoints").glob("version-*"))  # the learner saved on its way out


def test_in_process_demo_trains_and_writes_its_run_directory(tmp_path):
    run_dir = tmp_path / "demo"
    out = run("demo", "--in-process", "--steps", "2", "--prompts-per-step", "4", "--group-size", "2", "--delay", "fixed:1",
              "--run-dir", str(run_dir))
    assert out.returncode == 0, out.stderr
    assert "before" in out.stdout and "after" in out.stdout and str(run_dir) in out.stdout
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert steps[1]["staleness_max"] == 1.0  # the second step trained on version-0 rollouts
    evals = json.loads((run_dir / "evals.json").read_text())
    assert [e["step"] for e in evals] == [0, 2]
    assert (run_dir / "training.png").stat().st_size > 10_000
    assert json.loads((run_dir / "config.json").read_text())["loss"]["name"] == "gepo"


@pytest.mark.parametrize(
    "args, message",
    [
        (["demo", "--loss", "ppo"], "unknown loss 'ppo'; choose one of"),
        (["demo", "--delay", "poisson:3"], "bad delay distribution 'poisson:3'"),
        (["demo", "--steps", "0"], "Invalid value for '--steps'"),
        (["demo", "--pickup-delay", "lognormal:5"], "bad pickup delay 'lognormal:5'"),
    ],
)
def test_demo_bad_options_name_themselves(args, message):
    out = run(*args, timeout=120)
    assert out.returncode != 0 and message in out.stderr and "Traceback" not in out.stderr
