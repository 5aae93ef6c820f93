"""--eval-every: the learner evaluates its own policy on held-out problems between steps, and the
step record (steps.jsonl, hence the trackers and the dashboard) holds eval_pass_at_1."""

from pathlib import Path

import pytest

from swarm.cli.launcher import LocalSwarm
from swarm.config import LearnerConfig
from swarm.evaluation import HeldOutEvaluation
from swarm.model.loading import load_policy
from swarm.runlog import read_jsonl
from swarm.tasks import load_problems

STATIC = Path(__file__).parents[2] / "swarm" / "dashboard" / "static"


def test_held_out_evaluation_in_place_leaves_the_model_training():
    model, tokenizer = load_policy("embedded")
    model.train()
    problems = load_problems("arithmetic", {}, tokenizer=tokenizer, split="test")[:3]
    evaluation = HeldOutEvaluation(model, tokenizer, problems, samples=2, temperature=1.0, max_completion_length=12, seed=0)
    try:
        first, again = evaluation.run(), evaluation.run()
    finally:
        evaluation.close()
    assert 0.0 <= first["eval_pass_at_1"] <= 1.0 and first["eval_seconds"] > 0
    assert again["eval_pass_at_1"] == first["eval_pass_at_1"]  # the same draws for the same weights
    assert model.training
    with pytest.raises(ValueError, match="no held-out"):
        HeldOutEvaluation(model, tokenizer, [], samples=1, temperature=1.0, max_completion_length=4, seed=0)


def test_off_by_default_and_charted_on_the_dashboard():
    assert LearnerConfig(peers=["/ip4/127.0.0.1/tcp/1/p2p/QmX"]).eval_every == 0
    assert '"eval_pass_at_1"' in (STATIC / "dashboard.js").read_text()


def test_a_learner_with_eval_every_records_held_out_pass_at_1(tmp_path):
    swarm = LocalSwarm(tmp_path, run_id="evals")
    try:
        addr = swarm.start_bootstrap()
        learner, key = swarm.start_learner(addr, "--steps", "2", "--groups-per-step", "2", "--checkpoint-every", "0",
                                           "--eval-every", "2", "--eval-problems", "2", "--eval-samples", "1")
        swarm.start_sampler("sampler-0", addr, key, "--prompts-per-round", "2", "--num-generations", "4")
        assert learner.popen.wait(timeout=240) == 0, learner.text()[-3000:]
    finally:
        swarm.stop_all()
    steps = [r for r in read_jsonl(tmp_path / "learner" / "steps.jsonl") if "step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert "eval_pass_at_1" not in steps[0] and 0.0 <= steps[1]["eval_pass_at_1"] <= 1.0
    assert "held-out pass@1 at version 2" in learner.text()
