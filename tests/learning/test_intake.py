"""What a learner accepts into a batch (swarm/intake.py): the learner decodes the completion tokens
itself and scores that text, so a sampler can forge neither rewards nor texts; stale, old and
unknown groups are dropped by reason, and the sender's faults are reported for bans. A group's
prompt must be the one the task builds for its problem id, and a group whose content was already
accepted is refused whatever its id (issue 45)."""

import copy
import time

import pytest

from swarm.intake import GroupIntake
from swarm.replays import SeenContent
from swarm.model.loading import load_policy
from swarm.rollouts import RolloutGroup


@pytest.fixture(scope="module")
def tokenizer():
    return load_policy("embedded")[1]


def group(tokenizer, texts, rewards, *, claimed_texts=None, version=5, created_at=None, problem_id="p1"):
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    return RolloutGroup(problem_id=problem_id, prompt_ids=[1, 2], completion_ids=ids, sampler_logprobs=[[-1.0] * len(i) for i in ids],
                        rewards=rewards, version=version, sampler_id="s", completion_texts=claimed_texts if claimed_texts is not None else texts,
                        created_at=created_at or time.time(), sender="peer-a")


@pytest.fixture
def intake(tokenizer):
    strikes = []
    made = GroupIntake({"p1": "42"}, decode=lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True), max_staleness=4,
                       max_age_s=60, penalise=lambda peer, reason: strikes.append((peer, reason)), temperature=1.0)
    made.strikes = strikes
    yield made
    made.close()


def test_honest_group_is_accepted_with_the_learners_own_rewards(intake, tokenizer):
    g = group(tokenizer, ["\\boxed{42}", "\\boxed{41}"], [1.0, 0.0])
    assert intake.accept(g, learner_version=6)
    assert g.rewards == [1.0, 0.0] and g.completion_texts == ["\\boxed{42}", "\\boxed{41}"]
    assert not intake.dropped and not intake.strikes


def test_texts_that_do_not_match_the_tokens_cannot_earn_a_reward(intake, tokenizer):
    # right answers in the texts, wrong ones in the tokens the learner would train on
    forged = group(tokenizer, ["\\boxed{7}", "\\boxed{8}"], [1.0, 1.0], claimed_texts=["\\boxed{42}", "\\boxed{42}"])
    assert not intake.accept(forged, learner_version=6)
    assert intake.dropped == {"reward mismatch": 1} and intake.strikes == [("peer-a", "reward mismatch")]


def test_a_group_sent_without_texts_is_scored_from_its_tokens(intake, tokenizer):
    g = group(tokenizer, ["\\boxed{42}", "\\boxed{3}"], [1.0, 0.0], claimed_texts=[])
    assert intake.accept(g, learner_version=5)
    assert g.completion_texts == ["\\boxed{42}", "\\boxed{3}"]


def test_stale_old_and_unknown_groups_are_dropped_by_reason(intake, tokenizer):
    assert not intake.accept(group(tokenizer, ["\\boxed{42}"] * 2, [1.0, 1.0], version=1), learner_version=6)
    assert not intake.accept(group(tokenizer, ["\\boxed{42}"] * 2, [1.0, 1.0], created_at=time.time() - 120), learner_version=6)
    assert not intake.accept(group(tokenizer, ["\\boxed{42}"] * 2, [1.0, 1.0], problem_id="nope"), learner_version=6)
    assert intake.dropped == {"too stale": 1, "too old": 1, "unknown problem": 1}
    assert intake.strikes == [("peer-a", "unknown problem")]  # staleness and age are never the sender's fault


def test_a_batch_whose_step_did_not_happen_is_held_over_for_the_next_one(intake, tokenizer):
    """A learner that takes another learner's state instead of stepping (OutOfStep) keeps its batch:
    the next step takes it first, up to its share, oldest first; what went too stale or too old
    meanwhile is dropped by reason, without blame."""
    batch = [group(tokenizer, ["\\boxed{42}", f"\\boxed{{{i}}}"], [1.0, 0.0], version=v) for i, v in enumerate((3, 5, 6))]
    assert all(intake.accept(g, learner_version=6) for g in batch)
    intake.hold_over(batch)
    assert intake.held_over == 3
    assert intake.take_held(learner_version=7, limit=2) == batch[:2]  # one more step of staleness: all within 4
    assert intake.take_held(learner_version=7, limit=2) == batch[2:]
    assert intake.take_held(learner_version=7, limit=2) == []
    old = group(tokenizer, ["\\boxed{42}", "\\boxed{9}"], [1.0, 0.0], version=6)
    intake.hold_over([*batch, old])
    old.created_at = time.time() - 120  # past max_age_s while it waited
    assert intake.take_held(learner_version=10, limit=8) == batch[2:]  # versions 3 and 5: over 4 steps stale by now
    assert intake.dropped == {"too stale": 2, "too old": 1} and not intake.strikes
    assert intake.held == [] and intake.held_over == 7


def test_groups_sampled_with_other_settings_are_refused_before_anything_else(intake, tokenizer):
    """A learner steps on one sampling distribution; a claimed temperature of 1e-40 would make the
    recomputed log-probs non-finite (issue: one group poisons the model)."""
    for settings in ({"temperature": 1e-40}, {"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.9}):
        g = group(tokenizer, ["\\boxed{42}"] * 2, [1.0, 1.0])
        for key, value in settings.items():
            setattr(g, key, value)
        assert not intake.accept(g, learner_version=6), settings
    assert intake.dropped == {"other sampling settings": 4}
    assert intake.strikes == [("peer-a", "other sampling settings")] * 4


def test_a_group_that_breaks_a_check_is_refused_not_raised(tokenizer):
    def decode(ids):  # any failure inside a check, here in decoding
        raise IndexError(f"token id {ids[0][0]} outside the vocabulary")

    strikes = []
    intake = GroupIntake({"p1": "42"}, decode=decode, max_staleness=4, max_age_s=60, temperature=1.0,
                         penalise=lambda peer, reason: strikes.append((peer, reason)))
    try:
        assert not intake.accept(group(tokenizer, ["\\boxed{42}"] * 2, [1.0, 1.0]), learner_version=6)
    finally:
        intake.close()
    assert intake.dropped == {"could not be checked": 1} and strikes == [("peer-a", "could not be checked")]


def test_completions_end_at_the_runs_stop_string(tokenizer):
    """The learner scores a completion up to its first stop string, and refuses one whose tokens go
    on after it (they would be trained on and never scored); samplers cut there themselves."""
    from swarm.generation.base import Generation
    from swarm.sampling import truncate_at_stop

    stops = ["\nQ:"]
    ids = tokenizer.encode("\\boxed{42}\nQ: and \\boxed{7}", add_special_tokens=False)
    full = Generation([1], [ids], [[-1.0] * len(ids)], [tokenizer.decode(ids, skip_special_tokens=True)], [False])
    cut = truncate_at_stop(full, tokenizer, stops)
    kept = cut.completion_ids[0]
    assert 0 < len(kept) < len(ids) and kept == ids[: len(kept)] and len(cut.completion_logprobs[0]) == len(kept)
    assert "\nQ:" in cut.texts[0] and "\nQ:" not in tokenizer.decode(kept[:-1], skip_special_tokens=True)
    assert truncate_at_stop(full, tokenizer, ["never written"]).completion_ids == [ids]

    strikes = []
    intake = GroupIntake({"p1": "42"}, decode=lambda batch: tokenizer.batch_decode(batch, skip_special_tokens=True),
                         max_staleness=4, max_age_s=60, penalise=lambda peer, reason: strikes.append(reason),
                         temperature=1.0, stop_strings=stops)
    try:
        def sent(tokens):
            return RolloutGroup(problem_id="p1", prompt_ids=[1, 2], completion_ids=[tokens, tokens],
                                sampler_logprobs=[[-1.0] * len(tokens)] * 2, rewards=[1.0, 1.0], version=5, sampler_id="s",
                                sender="peer-a")

        assert intake.accept(sent(kept), learner_version=5)  # scored on "\boxed{42}", the stop string cut
        assert not intake.accept(sent(ids), learner_version=5)  # "\boxed{7}" after the stop would be trained on
        assert strikes == ["tokens past a stop string"]
    finally:
        intake.close()


def test_a_group_whose_prompt_is_not_its_problems_is_refused_and_counted_against_the_sender(tokenizer):
    """Issue 45: groups carried real problem ids with another problem's prompt (or an invented one)
    and the id's gold answer as the right completion; the learner scored them by id alone."""
    prompts = {"p1": "Compute 40+2. Answer in \\boxed{}.\n", "p2": "Compute 3+4. Answer in \\boxed{}.\n"}
    strikes = []
    intake = GroupIntake({"p1": "42", "p2": "7"}, decode=lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True),
                         max_staleness=4, max_age_s=60, penalise=lambda peer, reason: strikes.append(reason), temperature=1.0,
                         prompts=prompts, encode=lambda text: tokenizer(text)["input_ids"])
    try:
        own = group(tokenizer, ["\\boxed{42}", "\\boxed{41}"], [1.0, 0.0])
        own.prompt_ids = tokenizer(prompts["p1"])["input_ids"]
        assert intake.accept(own, learner_version=5)
        for prompt in (prompts["p2"], "Say 42. \\boxed{}\n", prompts["p1"] + " "):  # another problem's, invented, one space more
            wrong = group(tokenizer, ["\\boxed{42}", "\\boxed{42}"], [1.0, 1.0])
            wrong.prompt_ids = tokenizer(prompt)["input_ids"]
            assert not intake.accept(wrong, learner_version=5), prompt
    finally:
        intake.close()
    assert intake.dropped == {"prompt not its problem's": 3} and strikes == ["prompt not its problem's"] * 3
    with pytest.raises(ValueError, match="both"):
        GroupIntake({}, decode=str, max_staleness=1, max_age_s=1, penalise=print, temperature=1.0, prompts=prompts)


def test_a_group_already_accepted_is_refused_whatever_its_id_claims_and_order(intake, tokenizer):
    """Issue 45: one valid group re-sent under fresh ids was trained on 12 times in 3 steps."""
    first = group(tokenizer, ["\\boxed{42}", "\\boxed{41}", "\\boxed{42}"], [1.0, 0.0, 1.0])
    assert intake.accept(copy.deepcopy(first), learner_version=5)
    again = copy.deepcopy(first)
    again.completion_ids.reverse()  # other order, other claims, other version: the same content
    again.sampler_logprobs = [[-0.5] * len(c) for c in again.completion_ids]
    again.version, again.sender = 6, "peer-b"
    assert not intake.accept(again, learner_version=6)
    assert intake.dropped == {"same content as an accepted group": 1} and not intake.strikes  # two honest samplers at temperature 0 may agree
    other = group(tokenizer, ["\\boxed{42}", "\\boxed{41}", "\\boxed{40}"], [1.0, 0.0, 0.0])  # one completion differs
    assert intake.accept(other, learner_version=6)
    # once the first is past the staleness window (4 versions), its content is forgotten
    late = copy.deepcopy(first)
    late.version = 10
    assert intake.accept(late, learner_version=10)
    assert len(intake.seen) == 2  # "other" (version 6) and "late": the first was forgotten


def test_the_content_memory_is_bounded():
    memory = SeenContent(window=1000, max_entries=3)
    groups = [RolloutGroup(problem_id="p", prompt_ids=[1], completion_ids=[[i]], sampler_logprobs=[[0.0]], rewards=[0.0],
                           version=0, sampler_id="s") for i in range(5)]
    for g in groups:
        memory.remember(g, learner_version=0)
    assert len(memory) == 3 and not memory.seen(groups[0], 0) and memory.seen(groups[4], 0)


def test_honest_samplers_prompts_pass_the_check(tokenizer):
    """The prompt tokens a real sampler sends (the transformers backend, prompts of unequal length
    padded together) are what the learner's encode gives for the task's prompt."""
    from swarm.generation import SamplingParams
    from swarm.generation.transformers_backend import TransformersBackend
    from swarm.model.loading import load_policy
    from swarm.rewards import RewardScorer
    from swarm.sampling import produce_rollouts
    from swarm.tasks import load_problems

    model, _ = load_policy("embedded")
    problems = load_problems("arithmetic", {}, tokenizer=tokenizer)[:6]
    scorer = RewardScorer()
    intake = GroupIntake({p.problem_id: p.answer for p in problems}, decode=lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True),
                         max_staleness=4, max_age_s=60, penalise=lambda peer, reason: None, temperature=1.0,
                         prompts={p.problem_id: p.prompt for p in problems}, encode=lambda text: tokenizer(text)["input_ids"])
    try:
        groups = produce_rollouts(TransformersBackend(model, tokenizer), scorer, problems,
                                  SamplingParams(num_completions=2, max_new_tokens=8, seed=0), version=0, sampler_id="s")
        assert len({len(g.prompt_ids) for g in groups}) > 1  # padded together
        assert all(intake.accept(g, learner_version=0) for g in groups), intake.dropped
    finally:
        intake.close()
        scorer.close()


def test_a_ban_rule_that_cannot_fire_is_refused_by_the_config():
    from swarm.config import LearnerConfig

    with pytest.raises(ValueError, match="raise --verify-ban-window"):
        LearnerConfig(peers=["127.0.0.1:1"], transport="grpc", verify_ban_after=5, verify_ban_window=3)
