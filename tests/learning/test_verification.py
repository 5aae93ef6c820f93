"""The learner recomputes the behaviour log-probs a sampler reports (swarm/verification.py): honest
groups pass in float32, a lying group is refused and its sender banned, a group at a version the
learner no longer holds is dropped without blame, and with one lying group among eight the step
stays the step of the seven honest groups."""

import copy
import threading
import time

import pytest
import torch

from swarm.generation import SamplingParams
from swarm.generation.transformers_backend import TransformersBackend
from swarm.intake import GroupIntake
from swarm.model.loading import load_policy
from swarm.rewards import RewardScorer
from swarm.rollouts import RolloutGroup
from swarm.tasks import load_problems
from swarm.config import LossConfig
from swarm.training import LearnerCore
from swarm.verification import LogprobVerifier

TOLERANCE = 0.1


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return load_policy("embedded")


@pytest.fixture(scope="module")
def honest_groups(policy):
    """Eight groups of eight sampled by the policy itself (version 3), with true log-probs."""
    model, tokenizer = policy
    backend = TransformersBackend(model, tokenizer)
    problems = load_problems("arithmetic", {}, tokenizer=tokenizer)[:8]
    params = SamplingParams(num_completions=8, temperature=1.0, max_new_tokens=16, seed=1)
    made, scorer = [], RewardScorer()
    try:
        for problem, gen in zip(problems, backend.generate([p.prompt for p in problems], params)):
            rewards = scorer.score(gen.texts, [problem.answer] * len(gen.texts))
            rewards[0] = 1.0 - (rewards[0] or 0.0)  # every group has a non-zero advantage to step on
            made.append(RolloutGroup(problem_id=problem.problem_id, prompt_ids=gen.prompt_ids, completion_ids=gen.completion_ids,
                                     sampler_logprobs=gen.completion_logprobs, rewards=rewards, version=3, sampler_id="s",
                                     answer=problem.answer, sender="honest"))
    finally:
        scorer.close()
    return made


def lying(group: RolloutGroup, shift: float = -1.0) -> RolloutGroup:
    """The same completions, claiming smaller behaviour log-probs (so larger importance weights)."""
    liar = copy.deepcopy(group)
    liar.sampler_logprobs = [[x + shift for x in lp] for lp in liar.sampler_logprobs]
    liar.sender = "liar"
    return liar


def verifier_for(policy, *, fraction=1.0, versions=(3,)):
    model, tokenizer = policy
    states = {v: {k: t.clone() for k, t in model.state_dict().items()} for v in versions}
    return LogprobVerifier(model, states, lock=threading.RLock(), pad_token_id=tokenizer.pad_token_id, fraction=fraction,
                           tolerance=TOLERANCE)


def test_honest_groups_pass_and_a_liar_is_caught(policy, honest_groups):
    verifier = verifier_for(policy)
    assert all(verifier.check(g) is None for g in honest_groups)
    assert verifier.largest_honest_gap < TOLERANCE / 100  # float32 against float32: rounding only
    for shift in (-1.0, -0.2, 0.5):
        refused = verifier.check(lying(honest_groups[0], shift))
        assert refused is not None and "do not match version 3" in refused, shift
    assert verifier.checked == len(honest_groups) + 3


def test_the_intake_bans_a_liar_at_once_and_drops_unheld_versions_without_blame(policy, honest_groups):
    _, tokenizer = policy
    penalties = []
    intake = GroupIntake({g.problem_id: g.answer for g in honest_groups},
                         decode=lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True), max_staleness=8,
                         max_age_s=600, penalise=lambda peer, reason, ban=False: penalties.append((peer, ban)),
                         temperature=1.0, verifier=verifier_for(policy))
    try:
        fresh = [copy.deepcopy(g) for g in honest_groups[:2]]
        for g in fresh:  # rewards as the learner scores them (the fixture flipped one to have an advantage)
            g.created_at = time.time()
            g.rewards = intake.scorer.score(tokenizer.batch_decode(g.completion_ids, skip_special_tokens=True),
                                            [g.answer] * g.size)
        assert intake.accept(fresh[0], learner_version=3)
        liar = lying(fresh[1])
        assert not intake.accept(liar, learner_version=3)
        assert penalties == [("liar", True)] and intake.dropped["log-prob mismatch"] == 1
        unheld = copy.deepcopy(fresh[0])
        unheld.version = 2  # the learner holds only version 3 (say it restarted from there)
        assert not intake.accept(unheld, learner_version=3)
        assert intake.dropped["version not held"] == 1 and penalties == [("liar", True)]
    finally:
        intake.close()


def step_direction(policy, groups) -> torch.Tensor:
    """The gradient of one learner step on `groups` with the paper's GEPO, as one flat vector. An
    importance-weighted loss is what a liar about behaviour log-probs steers; TOPR, the default, uses
    them only to truncate negative-advantage sequences, so this lie (larger weights) cannot move it."""
    model, tokenizer = policy
    learner = copy.deepcopy(model)
    core = LearnerCore(learner, tokenizer.pad_token_id, version=3, loss=LossConfig(name="gepo", gepo_clip="weight"))
    core.step([copy.deepcopy(g) for g in groups])
    return torch.cat([p.grad.flatten() for p in learner.parameters() if p.grad is not None])


def test_one_lying_group_among_eight_does_not_steer_the_step(policy, honest_groups):
    """The issue's acceptance: cosine between the step taken and the step of the 7 honest groups
    alone > 0.9. Without verification the liar steers it; with it the liar's group is refused."""
    honest, liar = honest_groups[:7], lying(honest_groups[7], shift=-3.0)
    reference = step_direction(policy, honest)
    unguarded = step_direction(policy, honest + [liar])
    cosine = torch.nn.functional.cosine_similarity
    assert float(cosine(unguarded, reference, dim=0)) < 0.9  # the attack works when nobody checks

    verifier = verifier_for(policy)
    kept = [g for g in honest + [liar] if verifier.check(g) is None]
    assert liar not in kept and len(kept) == 7
    assert float(cosine(step_direction(policy, kept), reference, dim=0)) > 0.9
