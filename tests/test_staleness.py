"""Delay distributions, the policy ring, and the learner core on real rollout groups."""

import random

import pytest
import torch

from swarm.rollouts import RolloutGroup, collate
from swarm.staleness import DelayDistribution, PolicyRing, sampler_version


def test_delay_distributions_parse_and_draw():
    rng = random.Random(0)
    assert DelayDistribution.parse("none").draw(rng) == 0
    assert DelayDistribution.parse("fixed:8").draw(rng) == 8
    draws = [DelayDistribution.parse("uniform:4").draw(rng) for _ in range(500)]
    assert set(draws) == {0, 1, 2, 3, 4}
    paper = DelayDistribution.parse("lognormal:60,1920,30")  # the paper's delays at 30 s per step
    draws = [paper.draw(rng) for _ in range(2000)]
    assert min(draws) >= 2 and max(draws) <= 64 and paper.max_steps == 64
    median = sorted(draws)[len(draws) // 2]
    assert 10 <= median <= 16  # geometric mean of 60 and 1920 s is 339 s, i.e. ~11 steps


@pytest.mark.parametrize("spec", ["", "fixed", "fixed:-1", "uniform:x", "lognormal:100,50,1", "poisson:3"])
def test_bad_delay_specs_are_named(spec):
    with pytest.raises(ValueError, match="bad delay distribution"):
        DelayDistribution.parse(spec)


def test_policy_ring_keeps_the_newest_and_caps_staleness():
    model = torch.nn.Linear(2, 2)
    ring = PolicyRing(capacity=3)
    for version in range(5):
        with torch.no_grad():
            model.weight.fill_(version)
        ring.publish(version, model)
    assert (ring.oldest, ring.newest) == (2, 4)
    assert ring.get(3)["weight"].eq(3).all()
    with pytest.raises(KeyError, match="version 1 is not in the ring"):
        ring.get(1)
    assert sampler_version(4, 1, ring, max_staleness=64) == 3
    assert sampler_version(4, 10, ring, max_staleness=64) == 2  # nothing older exists
    assert sampler_version(4, 10, ring, max_staleness=1) == 3  # never staler than tolerated


def test_collate_pads_prompts_left_and_completions_right():
    groups = [
        RolloutGroup("a", [5, 6, 7], [[1, 2], [3]], [[-0.1, -0.2], [-0.3]], [1.0, None], version=2, sampler_id="s"),
        RolloutGroup("b", [8], [[4, 4, 4]], [[-1.0, -1.0, -1.0]], [0.0], version=5, sampler_id="s"),
    ]
    b = collate(groups, pad_id=0)
    assert b.prompt_ids.tolist() == [[5, 6, 7], [5, 6, 7], [0, 0, 8]]
    assert b.prompt_mask.tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 1]]
    assert b.completion_ids.tolist() == [[1, 2, 0], [3, 0, 0], [4, 4, 4]]
    assert b.completion_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]
    assert b.sampler_logprobs[0].tolist() == pytest.approx([-0.1, -0.2, 0.0])
    assert b.rewards[0].item() == 1.0 and torch.isnan(b.rewards[1]) and b.rewards[2].item() == 0.0
    assert b.group_ids.tolist() == [0, 0, 1] and b.versions.tolist() == [2, 2, 5]
