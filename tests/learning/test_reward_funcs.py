"""--reward-funcs / --reward-weights: the rewards every role scores with, checked when the config is read."""

import pytest
from pydantic import ValidationError

from swarm.config import LearnerConfig, SamplerConfig, TaskSettings, TrainerConfig
from swarm.config.learner_keys import encode_learner_key
from swarm.rewards import RewardScorer

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmPeer"


def test_weighted_rewards_are_what_every_role_scores_with():
    options = dict(reward_funcs=["accuracy", "format"], reward_weights=[1.0, 0.5])
    learner = LearnerConfig(peers=[PEER], **options)
    sampler = SamplerConfig(peers=[PEER], learner_keys=[encode_learner_key(b"[owner:k]")], **options)
    assert learner.reward_spec() == sampler.reward_spec() == TrainerConfig(**options).reward_spec() == [
        ("accuracy", 1.0), ("format", 0.5)]
    scorer = RewardScorer(learner.reward_spec())
    try:
        assert scorer.score(["so \\boxed{4}", "\\boxed{5}", "4", "\\boxed{4} and more"], ["4"] * 4) == [1.5, 0.5, 0.0, 1.0]
    finally:
        scorer.close()
    assert TaskSettings().reward_spec() == [("accuracy", 1.0)]  # the default: correctness alone
    assert TaskSettings(reward_funcs=["format", "accuracy"]).reward_spec() == [("format", 1.0), ("accuracy", 1.0)]


@pytest.mark.parametrize("options, message", [
    (dict(reward_funcs=["accuracy", "format"], reward_weights=[1.0]), "1 weight\\(s\\) for 2 --reward-funcs"),
    (dict(reward_funcs=["acuracy"]), "unknown reward 'acuracy'"),
    (dict(reward_funcs=["no_such_module:reward"]), "cannot import reward"),
    (dict(reward_funcs=[]), "at least one reward"),
])
def test_bad_rewards_are_refused_when_the_config_is_read(options, message):
    with pytest.raises(ValidationError, match=message):
        TaskSettings(**options)
