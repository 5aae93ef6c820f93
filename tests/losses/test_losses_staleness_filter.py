"""The staleness study's "drop older than J" filter (prime-rl's rule): delay distributions ending in
/drop:J (swarm/staleness.py) and the study's --drop-older-than option (benchmarks/staleness.py).
Kept beside the loss tests because it is the study setting the new objectives are compared under."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.staleness import DelayDistribution

ROOT = Path(__file__).resolve().parents[2]


def test_uniform_delays_with_a_drop_keep_only_fresh_enough_groups_in_equal_shares():
    dist = DelayDistribution.parse("uniform:8/drop:3")
    assert dist.drop_over == 3 and dist.max_steps == 3
    rng = random.Random(0)
    draws = [dist.draw(rng) for _ in range(8000)]
    # uniform over 0..8 conditioned on <= 3: uniform over 0..3
    assert set(draws) == {0, 1, 2, 3}
    assert all(abs(draws.count(k) / len(draws) - 0.25) < 0.02 for k in range(4))
    # 5 of the 9 equally likely delays (4..8) are dropped
    assert dist.dropped_fraction() == pytest.approx(5 / 9)
    base = DelayDistribution.parse("uniform:8")
    assert base.dropped_fraction() == 0.0 and base.max_steps == 8
    assert DelayDistribution.parse("uniform:8/drop:8").dropped_fraction() == 0.0


def test_lognormal_drop_fraction_matches_the_base_distributions_tail():
    spec = "lognormal:60,1920,30"  # the paper's delays, 2..64 steps at 30 s per step
    base, dropping = DelayDistribution.parse(spec), DelayDistribution.parse(spec + "/drop:8")
    rng = random.Random(1)
    tail = sum(base.draw(rng) > 8 for _ in range(20000)) / 20000
    assert dropping.dropped_fraction() == pytest.approx(tail, abs=0.01)
    assert 0.3 < tail < 0.9  # the median delay is about 11 steps: most, not all, are dropped
    draws = [dropping.draw(rng) for _ in range(2000)]
    assert max(draws) == 8 and min(draws) == 2 and dropping.max_steps == 8


@pytest.mark.parametrize("spec, message", [
    ("fixed:8/drop:4", "drops every group"),
    ("lognormal:600,1920,30/drop:8", "drops every group"),  # never fresher than 20 steps
    ("uniform:8/drop", "after '/' write drop:K"),
    ("uniform:8/keep:3", "after '/' write drop:K"),
    ("uniform:8/drop:-1", "after '/' write drop:K"),
    ("uniform:x/drop:3", "bad delay distribution 'uniform:x'"),
])
def test_bad_drop_specs_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        DelayDistribution.parse(spec)


def test_the_trainer_config_accepts_a_dropping_delay():
    from swarm.config import TrainerConfig

    assert TrainerConfig(delay="uniform:64/drop:8").delay == "uniform:64/drop:8"
    with pytest.raises(ValueError, match="drops every group"):
        TrainerConfig(delay="fixed:64/drop:8")


def test_the_study_maps_drop_older_than_onto_each_level():
    from benchmarks.staleness import delay_spec

    assert delay_spec("uniform", 64, 8) == "uniform:64/drop:8"
    assert delay_spec("lognormal", 64, 8) == "lognormal:60,1920,30/drop:8"
    assert delay_spec("uniform", 8, 8) == "uniform:8"  # nothing is older than 8 at staleness 8
    assert delay_spec("uniform", 0, 8) == "none"
    assert delay_spec("uniform", 64) == "uniform:64"


def test_the_study_refuses_a_drop_that_leaves_no_group(tmp_path):
    out = subprocess.run([sys.executable, "-m", "benchmarks.staleness", "--staleness", "0,64", "--delay-shape", "fixed",
                          "--drop-older-than", "8", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "--drop-older-than 8" in out.stderr and "drops every group" in out.stderr
    assert not (tmp_path / "staleness_runs.partial.jsonl").exists()


@pytest.mark.slow
def test_a_study_with_a_drop_trains_only_on_groups_that_fresh(tmp_path):
    tiny = ["--steps", "4", "--prompts-per-step", "2", "--group-size", "2", "--eval-every", "4", "--eval-problems", "4",
            "--advantage-every", "0"]
    out = subprocess.run([sys.executable, "-m", "benchmarks.staleness", "--losses", "m2po", "--staleness", "6",
                          "--drop-older-than", "1", "--seeds", "1", "--workers", "1", "--out", str(tmp_path), *tiny],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "71% at staleness 6" in out.stdout  # 5 of the 7 delays 0..6 are dropped
    result = json.loads((tmp_path / "staleness.json").read_text())
    assert result["settings"]["drop_older_than"] == 1
    assert result["settings"]["dropped_share"] == {"6": pytest.approx(5 / 7, abs=1e-4)}
    [run] = result["runs"]
    assert max(h["staleness_max"] for h in run["history"]) <= 1
