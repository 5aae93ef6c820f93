"""The staleness study's command (benchmarks/staleness.py) end to end at toy size: real training runs
in real worker processes, the report files, interruption recovery and refusal of bad options."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def study(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.staleness", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


TINY = ["--steps", "3", "--prompts-per-step", "2", "--group-size", "2", "--eval-every", "3", "--eval-problems", "4",
        "--advantage-every", "2"]


@pytest.mark.slow
def test_study_runs_every_job_in_two_workers_and_writes_the_report(tmp_path):
    out = study("--losses", "gepo,grpo", "--staleness", "0,2", "--seeds", "2", "--workers", "2", "--out", str(tmp_path), *TINY)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "staleness.json").read_text())
    jobs = {(r["loss"], r["staleness"], r["seed"]) for r in result["runs"]}
    assert jobs == {(loss, k, seed) for loss in ("gepo", "grpo") for k in (0, 2) for seed in (0, 1)}
    for run in result["runs"]:
        assert [e["step"] for e in run["evals"]] == [0, 3]
        assert len(run["history"]) == 3
        # Staleness 0 is online RL; staleness 2 never exceeds 2 steps.
        assert max(h["staleness_max"] for h in run["history"]) <= run["staleness"]
        assert "adv_err_gepo" in run["history"][0] and "adv_err_gepo" not in run["history"][1]
    assert set(result["summary"]) == {"gepo@0", "gepo@2", "grpo@0", "grpo@2"}
    assert all(s["seeds"] == 2 for s in result["summary"].values())
    md = (tmp_path / "staleness.md").read_text()
    assert "| gepo | 2 |" in md and "Drop of last accuracy from staleness 0 to 2" in md
    assert (tmp_path / "staleness_curves.png").stat().st_size > 10_000
    assert (tmp_path / "staleness_diagnostics.png").stat().st_size > 10_000
    assert not (tmp_path / "staleness_runs.partial.jsonl").exists()
    assert "[8/8]" in out.stdout


@pytest.mark.slow
def test_an_interrupted_study_is_reported_from_its_partial_runs(tmp_path):
    out = study("--losses", "gepo", "--staleness", "0", "--seeds", "1", "--workers", "1", "--out", str(tmp_path), *TINY)
    assert out.returncode == 0, out.stderr[-3000:]
    run = json.loads((tmp_path / "staleness.json").read_text())["runs"][0]
    # As if the study had been stopped after this run: its line is all that is left.
    (tmp_path / "staleness_runs.partial.jsonl").write_text(json.dumps(run) + "\n")
    (tmp_path / "staleness.json").unlink()
    out = study("--from-partial", "--losses", "gepo,grpo", "--staleness", "0,8", "--out", str(tmp_path), *TINY)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "staleness.json").read_text())
    assert result["runs"] == [run] and set(result["summary"]) == {"gepo@0"}
    assert "Interrupted study: 1 of 12 planned runs" in (tmp_path / "staleness.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--losses", "gepo,ppo2"], "unknown loss(es) ['ppo2']"),
    (["--workers", "0"], "--workers must be >= 1"),
    (["--staleness", "0,-8"], "staleness levels >= 0"),
])
def test_bad_study_options_are_named(tmp_path, args, message):
    out = study(*args, "--out", str(tmp_path), timeout=60)
    assert out.returncode == 2 and message in out.stderr
    assert not (tmp_path / "staleness_runs.partial.jsonl").exists()


def test_from_partial_without_an_interrupted_study_says_so(tmp_path):
    out = study("--from-partial", "--out", str(tmp_path), timeout=60)
    assert out.returncode == 2 and "no " + str(tmp_path / "staleness_runs.partial.jsonl") in out.stderr
