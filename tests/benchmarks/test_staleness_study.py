"""The staleness study's command (benchmarks/staleness.py) end to end at toy size: real training runs
in real worker processes, the report files, interruption recovery and refusal of bad options."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


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
    assert "## Stability, by loss and level" in md and all("grad_norm" in h for r in result["runs"] for h in r["history"])
    assert (tmp_path / "staleness_curves.png").stat().st_size > 10_000
    assert (tmp_path / "staleness_diagnostics.png").stat().st_size > 10_000
    assert not (tmp_path / "staleness_runs.partial.jsonl").exists()
    assert "[8/8]" in out.stdout

    # The report can be rewritten from the results file alone, with the runs and their machine untouched.
    again = study("--report-only", "--out", str(tmp_path), timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    rewritten = json.loads((tmp_path / "staleness.json").read_text())
    assert rewritten["runs"] == result["runs"] and rewritten["machine"] == result["machine"]
    assert (tmp_path / "staleness.md").read_text() == md


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


@pytest.mark.slow
def test_an_interrupted_study_is_not_erased_by_a_new_one_and_resume_runs_only_what_is_missing(tmp_path):
    out = study("--losses", "gepo", "--staleness", "0", "--seeds", "1", "--workers", "1", "--out", str(tmp_path), *TINY)
    assert out.returncode == 0, out.stderr[-3000:]
    [run] = json.loads((tmp_path / "staleness.json").read_text())["runs"]
    partial = tmp_path / "staleness_runs.partial.jsonl"
    # Killed while writing its second run: the last line is cut short.
    partial.write_text(json.dumps(run) + "\n" + json.dumps(run)[:40])
    args = ["--losses", "gepo,grpo", "--staleness", "0", "--seeds", "1", "--workers", "1", "--out", str(tmp_path), *TINY]
    again = study(*args, timeout=60)
    assert again.returncode == 2 and "holds 1 run(s) of an interrupted study: --resume finishes it" in again.stderr
    assert partial.read_text().startswith(json.dumps(run))  # left as it was

    resumed = study("--resume", *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "1 line(s) cut short" in resumed.stderr and "resuming: 1 of 2 runs already done" in resumed.stdout
    assert "[2/2] grpo" in resumed.stdout and "gepo     staleness" not in resumed.stdout  # gepo is not run again
    result = json.loads((tmp_path / "staleness.json").read_text())
    assert [r["loss"] for r in result["runs"]] == ["gepo", "grpo"] and result["runs"][0] == run
    assert "resume" not in result["settings"] and not partial.exists()


def test_resume_refuses_an_interrupted_study_with_other_settings_or_runs(tmp_path):
    partial = tmp_path / "staleness_runs.partial.jsonl"
    run = {"loss": "gepo", "staleness": 8, "seed": 0, "seconds": 1.0}
    partial.write_text(json.dumps({"settings": {"steps": 3, "lr": 2e-4}}) + "\n" + json.dumps(run) + "\n")
    out = study("--resume", "--losses", "gepo", "--staleness", "8", "--seeds", "1", "--steps", "4", "--out", str(tmp_path), timeout=60)
    assert out.returncode == 2 and "steps=3, now 4" in out.stderr
    out = study("--resume", "--losses", "grpo", "--staleness", "8", "--seeds", "1", "--steps", "3", "--out", str(tmp_path), timeout=60)
    assert out.returncode == 2 and "has runs this one does not plan ([('gepo', 8, 0)]);" in out.stderr
    out = study("--resume", "--from-partial", "--out", str(tmp_path), timeout=60)
    assert out.returncode == 2 and "choose one" in out.stderr
    assert json.loads(partial.read_text().splitlines()[1]) == run  # nothing rewritten


@pytest.mark.slow
def test_a_fixed_delay_shape_trains_on_groups_exactly_that_old(tmp_path):
    out = study("--losses", "grpo", "--staleness", "2", "--delay-shape", "fixed", "--seeds", "1", "--workers", "1",
                "--out", str(tmp_path), *TINY)
    assert out.returncode == 0, out.stderr[-3000:]
    [run] = json.loads((tmp_path / "staleness.json").read_text())["runs"]
    # Always 2 versions behind, except where fewer versions exist yet (the first steps).
    assert [h["staleness_mean"] for h in run["history"]] == [0, 1, 2]


@pytest.mark.parametrize("args, message", [
    (["--losses", "gepo,ppo2"], "unknown loss(es) ['ppo2']"),
    (["--workers", "0"], "--workers must be >= 1"),
    (["--staleness", "0,-8"], "staleness levels >= 0"),
    (["--delay-shape", "poisson"], "invalid choice: 'poisson'"),
])
def test_bad_study_options_are_named(tmp_path, args, message):
    out = study(*args, "--out", str(tmp_path), timeout=60)
    assert out.returncode == 2 and message in out.stderr
    assert not (tmp_path / "staleness_runs.partial.jsonl").exists()


def test_report_only_without_a_finished_study_says_so(tmp_path):
    out = study("--report-only", "--out", str(tmp_path), timeout=60)
    assert out.returncode == 2 and "no " + str(tmp_path / "staleness.json") in out.stderr


def curve_run(loss: str, staleness: int, seed: int, accs: list[float], staleness_mean: float = 0.0) -> dict:
    return {"loss": loss, "staleness": staleness, "seed": seed,
            "evals": [{"step": 10 * i, "pass_at_1": a} for i, a in enumerate(accs)],
            "history": [{"step": s, "staleness_mean": staleness_mean} for s in range(1, 10 * (len(accs) - 1) + 1)]}


def test_a_stale_run_is_placed_on_its_own_losses_online_curve():
    from benchmarks.staleness_report import first_step_reaching, online_equivalent_steps

    online = [(0, 0.1), (10, 0.2), (20, 0.4), (30, 0.4)]
    assert first_step_reaching(online, 0.3) == pytest.approx(15.0)  # halfway between the evaluations at 10 and 20
    assert first_step_reaching(online, 0.05) == 0.0 and first_step_reaching(online, 0.4) == 20.0
    assert first_step_reaching(online, 0.5) is None
    runs = [curve_run("gepo", 0, 0, [0.1, 0.2, 0.4, 0.4]), curve_run("gepo", 0, 1, [0.1, 0.2, 0.4, 0.6]),
            curve_run("gepo", 8, 0, [0.1, 0.2, 0.25, 0.3], staleness_mean=4.0),
            curve_run("gepo", 8, 1, [0.1, 0.2, 0.25, 0.3], staleness_mean=6.0),
            curve_run("grpo", 8, 0, [0.1, 0.2, 0.2, 0.2], staleness_mean=4.0)]  # no online run: no row
    # Seeds averaged: online curve 0.1, 0.2, 0.4, 0.5; the stale runs end at 0.3, reached at step 15;
    # the last 10 steps' groups were 5 steps old on average, so the lag alone predicts step 25.
    assert online_equivalent_steps(runs, ["gepo", "grpo"], [0, 8]) == [["gepo", 8, "30.0", 15, 25]]


def test_stability_table_reports_gradient_spikes_and_tolerates_older_runs_without_them():
    from benchmarks.staleness_report import stability_by_loss

    def step(kl, var, clip, norm=None):
        h = {"kl_learner_sampler": kl, "is_weight_var": var, "clip_frac": clip}
        return h if norm is None else {**h, "grad_norm": norm}

    norms = [0.5] * 19 + [900.0]  # one spike among twenty steps
    runs = [{"loss": "topr", "staleness": 8, "seed": 0, "history": [step(0.01, 0.1, 0.2, n) for n in norms]},
            {"loss": "gepo", "staleness": 8, "seed": 0, "history": [step(0.02, 0.3, 0.0)] * 2}]
    rows = stability_by_loss(runs, ["gepo", "topr"], [0, 8])
    assert rows[0] == ["gepo", 8, 0.02, 0.3, 0.0, "-", "-", "-"]
    assert rows[1][:5] == ["topr", 8, 0.01, pytest.approx(0.1), pytest.approx(0.2)]
    assert rows[1][5:] == [0.5, 0.5, 900.0]  # median and p95 unmoved, the spike is the maximum
    assert len(rows) == 2  # no online runs: no rows for level 0


def test_from_partial_without_an_interrupted_study_says_so(tmp_path):
    out = study("--from-partial", "--out", str(tmp_path), timeout=60)
    assert out.returncode == 2 and "no " + str(tmp_path / "staleness_runs.partial.jsonl") in out.stderr


def test_delay_shapes_map_a_maximum_staleness_to_a_delay_distribution():
    from benchmarks.staleness import delay_spec
    from swarm.staleness import DelayDistribution

    assert delay_spec("lognormal", 64) == "lognormal:60,1920,30"  # the paper's 60..1920 s at 30 s per step
    for shape in ("uniform", "fixed", "lognormal"):
        assert delay_spec(shape, 0) == "none"
        assert DelayDistribution.parse(delay_spec(shape, 8)).max_steps == 8


@pytest.mark.slow
def test_a_loss_variant_and_a_later_stage_of_seeds_combine_into_one_report(tmp_path):
    """A variant NAME[key=value] runs with its own settings under its own label; a second stage adds
    seeds (--first-seed) to the first; --combine reports both stages' runs together, each once, and
    refuses stages trained with other settings."""
    variant = "gepo[gepo_clip=weight+token-neg]"
    first = study("--losses", f"grpo,{variant}", "--staleness", "2", "--seeds", "1", "--workers", "1",
                  "--out", str(tmp_path / "s1"), *TINY)
    assert first.returncode == 0, first.stderr[-3000:]
    second = study("--losses", variant, "--staleness", "2", "--seeds", "1", "--first-seed", "1", "--workers", "1",
                   "--out", str(tmp_path / "s2"), *TINY)
    assert second.returncode == 0, second.stderr[-3000:]
    s1 = json.loads((tmp_path / "s1" / "staleness.json").read_text())
    assert {(r["loss"], r["seed"]) for r in s1["runs"]} == {("grpo", 0), (variant, 0)}
    assert [r["seed"] for r in json.loads((tmp_path / "s2" / "staleness.json").read_text())["runs"]] == [1]

    out = study("--combine", str(tmp_path / "s1"), str(tmp_path / "s2"), str(tmp_path / "s1"), "--out",
                str(tmp_path / "all"), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    combined = json.loads((tmp_path / "all" / "staleness.json").read_text())
    assert sorted((r["loss"], r["seed"]) for r in combined["runs"]) == sorted([("grpo", 0), (variant, 0), (variant, 1)])
    assert combined["summary"][f"{variant}@2"]["seeds"] == 2 and combined["summary"]["grpo@2"]["seeds"] == 1
    assert "Combined from 3 stages" in (tmp_path / "all" / "staleness.md").read_text()

    other = study("--losses", "grpo", "--staleness", "2", "--seeds", "1", "--workers", "1", "--out", str(tmp_path / "s3"),
                  *TINY[:-2], "--advantage-every", "3")
    assert other.returncode == 0, other.stderr[-3000:]
    refused = study("--combine", str(tmp_path / "s1"), str(tmp_path / "s3"), "--out", str(tmp_path / "bad"), timeout=120)
    assert refused.returncode == 2 and "ran with other settings" in refused.stderr and "advantage_every=3" in refused.stderr
    assert not (tmp_path / "bad" / "staleness.json").exists()


@pytest.mark.parametrize("losses, message", [
    ("gepo[gepo_clip=sideways]", "Input should be 'weight'"),
    ("gepo[clipping=1]", "Extra inputs are not permitted at clipping"),
    ("gepo[epsilon]", "bad setting 'epsilon'"),
    ("nope[epsilon=0.1]", "unknown loss(es) ['nope[epsilon=0.1]']"),
    ("topr[max_grad_norm=-1]", "greater than or equal to 0 at max_grad_norm"),
])
def test_a_bad_loss_variant_is_refused_by_name(tmp_path, losses, message):
    out = study("--losses", losses, "--staleness", "0", "--out", str(tmp_path), timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "staleness_runs.partial.jsonl").exists()


def stages(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.staleness_stages", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_the_staged_study_runs_its_stages_resumes_an_interrupted_one_and_combines(tmp_path):
    """One command runs a plan's stages in order; given again it skips finished stages and resumes an
    interrupted one from its finished runs; the uniform-delay stages combine into one report and a
    log-normal stage reports on its own."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"stages": [
        {"name": "first", "losses": "gepo,grpo", "staleness": "0,2", "seeds": 1},
        {"name": "more_seeds", "losses": "gepo", "staleness": "2", "seeds": 1, "first_seed": 1},
        {"name": "lognormal", "losses": "grpo", "staleness": "2", "seeds": 1, "delay_shape": "lognormal"},
    ]}))
    out = tmp_path / "out"
    listed = stages("--plan", str(plan), "--out", str(out), "--list", timeout=60)
    assert listed.returncode == 0 and "first" in listed.stdout and "4 runs  to run" in listed.stdout, listed.stdout
    # Some stages alone: no combined report of a part of the study.
    part = stages("--plan", str(plan), "--out", str(out), "--only", "more_seeds", "--workers", "2", *TINY)
    assert part.returncode == 0, part.stderr[-3000:]
    assert "not combined" in part.stdout and "first not finished" in part.stdout and not (out / "combined").exists()
    done = stages("--plan", str(plan), "--out", str(out), "--workers", "2", *TINY)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "3 stage(s), 5 run(s) to go" in done.stdout and "more_seeds: done already" in done.stdout
    combined = json.loads((out / "combined" / "staleness.json").read_text())
    assert sorted((r["loss"], r["staleness"], r["seed"]) for r in combined["runs"]) == sorted(
        [("gepo", 0, 0), ("gepo", 2, 0), ("grpo", 0, 0), ("grpo", 2, 0), ("gepo", 2, 1)])
    assert combined["summary"]["gepo@2"]["seeds"] == 2
    lognormal = json.loads((out / "lognormal" / "staleness.json").read_text())
    assert lognormal["settings"]["delay_shape"] == "lognormal" and len(lognormal["runs"]) == 1

    # As if the second stage had been stopped after its run: the partial file alone is left.
    second = json.loads((out / "more_seeds" / "staleness.json").read_text())
    (out / "more_seeds" / "staleness.json").unlink()
    (out / "more_seeds" / "staleness_runs.partial.jsonl").write_text(
        json.dumps({"settings": second["settings"]}) + "\n" + json.dumps(second["runs"][0]) + "\n")
    again = stages("--plan", str(plan), "--out", str(out), "--workers", "2", *TINY)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "first: done already" in again.stdout and "lognormal: done already" in again.stdout
    assert "more_seeds: 1 runs, resuming" in again.stdout and "resuming: 1 of 1 runs already done" in again.stdout
    assert json.loads((out / "more_seeds" / "staleness.json").read_text())["runs"] == second["runs"]
    assert json.loads((out / "combined" / "staleness.json").read_text())["runs"] == combined["runs"]


@pytest.mark.parametrize("plan, args, message", [
    ({"stages": [{"name": "a", "losses": "gepo", "staleness": "0", "seed": 3}]}, [], "stage 1: seed: Extra inputs"),
    ({"stages": [{"name": "a/b", "losses": "gepo", "staleness": "0"}]}, [], "it names a directory"),
    ({"stages": [{"name": "a", "losses": "gepo", "staleness": "0"}] * 2}, [], "two stages share a name"),
    ({"stages": []}, [], "a non-empty list of stages"),
    ({"stages": [{"name": "a", "losses": "gepo", "staleness": "0"}]}, ["--only", "b"], "no stage b; the stages are a"),
    ({"stages": [{"name": "a", "losses": "gepo", "staleness": "0"}]}, ["--seeds", "2"], "--seeds: set by each stage"),
])
def test_a_bad_stage_plan_is_refused_by_name(tmp_path, plan, args, message):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    out = stages("--plan", str(path), "--out", str(tmp_path / "out"), *args, timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_the_study_plan_covers_every_loss_at_every_level_and_its_stages_fit_an_hour():
    """The default plan: every registered loss and the GEPO fix at 0, 8, 64 and 256 with 3 seeds; no
    stage over 80 runs (about an hour on two cores at the measured 1.5 single-thread minutes per run)."""
    from benchmarks.staleness import ALL_LOSSES, split_losses
    from benchmarks.staleness_stages import PLAN
    from swarm.losses import LOSSES

    assert set(ALL_LOSSES) == set(LOSSES)
    covered = {(loss, int(k), seed) for s in PLAN if s.combine for loss in split_losses(s.losses)
               for k in s.staleness.split(",") for seed in range(s.first_seed, s.first_seed + s.seeds)}
    for loss in [*ALL_LOSSES, "gepo[gepo_clip=weight+token-neg]"]:
        assert {(loss, k, seed) for k in (0, 8, 64, 256) for seed in range(3)} <= covered, loss
    assert all(s.runs() <= 80 for s in PLAN), [(s.name, s.runs()) for s in PLAN]
    assert [s.name for s in PLAN if not s.combine] == ["lognormal_at64", "drop_older_than_8_at64", "clipping_check_at_0_and_64"]


def test_a_bare_loss_name_is_its_papers_form_and_a_variant_may_change_the_optimizer():
    """'gepo' in the study is the paper's GEPO whatever the swarm's default clip, so that stages run
    before and after the default changed combine; optimizer keys go to the trainer, not the loss."""
    from benchmarks.staleness import variant_settings
    from swarm.config import LossConfig

    assert LossConfig(name="gepo").gepo_clip == "weight+token-neg"  # the swarm's default ...
    assert variant_settings("gepo") == ({"name": "gepo", "gepo_clip": "weight"}, {})  # ... is not the study's "gepo"
    assert variant_settings("gepo[gepo_clip=weight+token-neg]")[0]["gepo_clip"] == "weight+token-neg"
    assert variant_settings("topr[max_grad_norm=0;beta=0]") == ({"name": "topr", "topr_form": "paper", "beta": 0},
                                                                  {"max_grad_norm": 0})
