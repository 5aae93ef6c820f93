"""The learner recomputes the behaviour log-probs a sampler reports (swarm/verification.py): honest
groups pass in float32, a lying group is refused and its sender banned once a second one is found,
a group at a version the learner no longer holds is dropped without blame, the groups checked are
drawn from the OS's randomness, and with one lying group among eight the step stays the step of the
seven honest groups: refused when checked, bounded by the KL penalty's clamp when not (and, in an
importance-weighted loss, by the bound on how small a claimed q is taken)."""

import copy
import random
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
from swarm.verification import GapEvidence, LogprobVerifier

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


def test_one_group_over_the_tolerance_is_refused_and_the_second_bans():
    evidence = GapEvidence(ban_after=2, window=4)
    assert not evidence.record("honest", True)  # an honest GPU sampler's rare excursion: refused, not banned
    assert not any(evidence.record("honest", False) for _ in range(4))  # and forgotten after 4 clean checks
    assert not evidence.record("honest", True) and evidence.exceedances("honest") == 1
    assert not evidence.record("liar", True) and evidence.record("liar", True)  # two in a window: a liar
    assert evidence.exceedances("liar") == 0  # the record starts over when the ban expires
    with pytest.raises(ValueError, match="between 1 and verify_ban_window"):
        GapEvidence(ban_after=5, window=4)


def test_which_groups_are_checked_cannot_be_predicted_from_the_seed(policy):
    first, second = verifier_for(policy, fraction=0.4), verifier_for(policy, fraction=0.4)
    assert isinstance(first.rng, random.SystemRandom)  # the OS's randomness, not random.Random(--seed)
    draws = [[v.chosen() for _ in range(256)] for v in (first, second)]
    assert draws[0] != draws[1]  # same settings, other draws (equal with probability ~1e-77)
    assert 0.25 < sum(draws[0]) / 256 < 0.55


def test_the_intake_bans_a_liar_on_its_second_refusal_and_drops_unheld_versions_without_blame(policy, honest_groups):
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
        assert not intake.accept(lying(fresh[1]), learner_version=3)
        assert penalties == [] and intake.dropped["log-prob mismatch"] == 1  # refused; one is not yet evidence
        assert not intake.accept(lying(fresh[1], shift=-0.2), learner_version=3)
        assert penalties == [("liar", True)] and intake.dropped["log-prob mismatch"] == 2
        unheld = copy.deepcopy(fresh[1])
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


def step_gradient(policy, groups, loss: LossConfig) -> torch.Tensor:
    """The flat gradient of one learner step on `groups` with `loss`, unclipped."""
    model, tokenizer = policy
    learner = copy.deepcopy(model)
    core = LearnerCore(learner, tokenizer.pad_token_id, version=3, loss=loss, max_grad_norm=0.0)
    core.step([copy.deepcopy(g) for g in groups])
    return torch.cat([p.grad.flatten() for p in learner.parameters() if p.grad is not None])


def claims_certainty(policy, like: RolloutGroup) -> RolloutGroup:
    """Issue 45's step-steering group: completions of a wrong answer, honestly scored 0, each token
    claimed at log-prob 0 (q = 1), where the policy gives them far less."""
    _, tokenizer = policy
    # a wrong answer the policy finds unlikely (token log-probs down to -15.6): the larger the gap
    # between the claim and the policy, the harder an unbounded k3 term pulls
    ids = tokenizer("The answer is \\boxed{8086420}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return RolloutGroup(problem_id=like.problem_id, prompt_ids=like.prompt_ids, completion_ids=[ids] * like.size,
                        sampler_logprobs=[[0.0] * len(ids)] * like.size, rewards=[0.0] * like.size, version=3,
                        sampler_id="s", answer=like.answer, sender="liar")


def test_an_unchecked_lying_group_moves_the_default_step_no_more_than_an_honest_group(policy, honest_groups):
    """Issue 45's goal for a lie no check caught, with real gradients of the default loss (TOPR with
    the k3 KL penalty): cosine of the step with the step of the 7 honest groups > 0.9, and the lying
    group's own gradient no larger than an honest group's. Without the KL clamp the liar steers."""
    honest, liar = honest_groups[:7], claims_certainty(policy, honest_groups[7])
    cosine = torch.nn.functional.cosine_similarity
    for loss, steered in ((LossConfig(max_claimed_log_ratio=20.0), True), (LossConfig(), False)):  # the old clamp, the new
        reference = step_gradient(policy, honest, loss)
        with_liar = step_gradient(policy, honest + [liar], loss)
        alone = [float(step_gradient(policy, [g], loss).norm()) for g in honest]
        liar_alone = float(step_gradient(policy, [liar], loss).norm())
        if steered:  # the attack works against an unbounded claim
            assert float(cosine(with_liar, reference, dim=0)) < 0.9 and liar_alone > 10 * max(alone)
        else:
            assert float(cosine(with_liar, reference, dim=0)) > 0.9
            assert liar_alone <= max(alone), (liar_alone, alone)


@pytest.mark.parametrize("name", ["gepo", "grpo"])
def test_in_an_importance_weighted_loss_an_unchecked_lie_turns_the_step_no_more_than_an_honest_group(policy, honest_groups, name):
    """Issue 45's goal, "one lying group among 8 moves the step by no more than an honest group
    does", for the losses whose cosine with the 7 honest groups' step stays under 0.9 (measured 0.75
    GEPO, 0.67 GRPO): there the honest groups nearly cancel, and an honest eighth group turns the
    step as far. How far a group turns the step: 1 - cosine of the 8 groups' step with the step of
    the 7 others. The lying group (q e^3 below the truth, unchecked) turns it at most 1.1x as far as
    the honest group that turns it most (measured 1.006x GRPO, 0.75x GEPO)."""
    loss = LossConfig(name=name)
    cosine = torch.nn.functional.cosine_similarity

    def turn(groups, last):
        return 1.0 - float(cosine(step_gradient(policy, groups + [last], loss), step_gradient(policy, groups, loss), dim=0))
    honest = [turn([g for j, g in enumerate(honest_groups) if j != i], honest_groups[i]) for i in range(len(honest_groups))]
    liar = turn(honest_groups[:7], lying(honest_groups[7], shift=-3.0))
    assert liar <= 1.1 * max(honest), (liar, honest)


def test_an_unchecked_lie_weighs_no_more_than_an_honest_group_in_an_importance_weighted_loss(policy, honest_groups):
    """GEPO divides by the claimed q: a q e^3 below the truth made the lying group's gradient 2.9x
    the largest honest group's; with q taken no smaller than p e^-2 (max_claimed_log_ratio) it is
    within 1.1x of it (measured 2.41 against 2.27)."""
    liar = lying(honest_groups[7], shift=-3.0)
    for bound, limit in ((20.0, None), (2.0, 1.3)):
        loss = LossConfig(name="gepo", max_claimed_log_ratio=bound)
        largest_honest = max(float(step_gradient(policy, [g], loss).norm()) for g in honest_groups[:7])
        ratio = float(step_gradient(policy, [liar], loss).norm()) / largest_honest
        assert ratio < limit if limit else ratio > 2.0, (bound, ratio)


def test_a_group_at_a_version_rebuilt_in_the_background_is_deferred_then_checked_never_trained_on_unchecked(policy, honest_groups):
    """The learner holds versions 3..10, 3 as 7 undo deltas from 10: a check at version 3 does not
    rebuild it in the training thread (at most 2 undo deltas there); its groups wait, the honest one
    is accepted and the liar refused once it is rebuilt behind, and a group that goes past the
    staleness limit while waiting is dropped by reason, without blame."""
    from swarm.fabric.weights.delta import state_hash
    from swarm.fabric.weights.versions import VersionStore

    model, tokenizer = policy
    store = VersionStore(capacity=8, whole_states=1, cached_states=1, inline_undo=2)
    state = {k: t.detach().clone() for k, t in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    for version in range(3, 11):  # each later version a few elements moved one step of their bits
        store.add(version, state)
        state = {k: ((t.view(torch.int32) + (torch.rand(t.shape, generator=gen) < 0.02).int()).view(torch.float32)
                     if t.dtype == torch.float32 else t.clone()) for k, t in state.items()}
    verifier = LogprobVerifier(model, store.states, lock=threading.RLock(), pad_token_id=tokenizer.pad_token_id, fraction=1.0,
                               tolerance=TOLERANCE)
    penalties = []
    intake = GroupIntake({g.problem_id: g.answer for g in honest_groups},
                         decode=lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True), max_staleness=8,
                         max_age_s=600, penalise=lambda peer, reason, ban=False: penalties.append((peer, ban)),
                         temperature=1.0, verifier=verifier)
    try:
        fresh = [copy.deepcopy(g) for g in honest_groups[:3]]
        for g in fresh:
            g.created_at = time.time()
            g.rewards = intake.scorer.score(tokenizer.batch_decode(g.completion_ids, skip_special_tokens=True),
                                            [g.answer] * g.size)
        liar = lying(fresh[1])
        assert not intake.accept(fresh[0], learner_version=10) and not intake.accept(liar, learner_version=10)
        assert intake.deferrals == 2 and not intake.dropped and verifier.checked == 0  # nothing checked, nothing trained
        assert store.undo_applied["inline"] == 0
        store.behind.forget(3)  # what was asked for (or built) dropped unread: resume asks again
        deadline = time.monotonic() + 60
        accepted = []
        while len(intake.deferred) and time.monotonic() < deadline:  # as the learner's gathering loop does
            accepted += intake.resume(10)
            time.sleep(0.05)
        assert accepted == [fresh[0]] and intake.dropped == {"log-prob mismatch": 1} and verifier.checked == 2
        assert state_hash(store.states[3]) == store.hashes[3] and store.undo_applied["inline"] == 0
        # deferred, and too stale by the time its version is ready: dropped, nobody's fault
        verifier.loaded = None
        store._cache.clear()
        store.behind.forget(3)
        assert not intake.accept(fresh[2], learner_version=10) and intake.deferred == [fresh[2]]
        assert store.behind.busy() or store.behind.held()  # version 3 asked for again, behind
        assert intake.resume(12) == [] and intake.dropped["stale before its version was rebuilt"] == 1
        assert not intake.deferred and penalties == []
        # nobody waits for version 3 now: neither its rebuild nor a copy of it is kept for a reader
        assert not store.behind.busy() and store.behind.held() == 0
    finally:
        intake.close()
        deadline = time.monotonic() + 60
        while store.behind.busy() and time.monotonic() < deadline:  # (its rebuild ends before the test does)
            time.sleep(0.05)
