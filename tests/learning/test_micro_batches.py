"""Learner memory bounded by a micro-batch (swarm/training.py): a step taken in micro-batches, with
chunked log-probs and gradient checkpointing, is the one-batch step up to float rounding, for every
loss (token means weight by tokens and Dr.GRPO divides by the batch's padded width, so this needs
the batch's own totals, not a mean per micro-batch); and micro-batches are planned by groups and by
padded tokens without ever splitting a group."""

import copy
import random

import pytest
import torch

from swarm.config import LossConfig
from swarm.losses import LOSSES
from swarm.model.loading import load_policy
from swarm.rollouts import RolloutGroup
from swarm.training import LearnerCore, plan_micro_batches


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return load_policy("embedded")


def groups_of(seed: int = 0, count: int = 6) -> list[RolloutGroup]:
    """Groups of 4 with prompts and completions of different lengths (one empty completion), at
    versions 0..2, with made-up behaviour log-probs and rewards that vary within each group."""
    rng = random.Random(seed)
    made = []
    for i in range(count):
        prompt = [rng.randrange(3, 99) for _ in range(rng.randrange(4, 20))]
        completions = [[rng.randrange(3, 99) for _ in range(rng.randrange(0 if i == 2 and j == 0 else 1, 14))] for j in range(4)]
        if i == 2:
            completions[0] = []
        made.append(RolloutGroup(problem_id=f"p{i}", prompt_ids=prompt, completion_ids=completions,
                                 sampler_logprobs=[[-rng.uniform(0.5, 4.0) for _ in c] for c in completions],
                                 rewards=[float(rng.random() < 0.5) for _ in completions], version=i % 3, sampler_id="s"))
        made[-1].rewards[0], made[-1].rewards[1] = 1.0, 0.0  # an advantage in every group
    return made


def step(policy, groups, **options):
    model, tokenizer = policy
    learner = copy.deepcopy(model)
    core = LearnerCore(learner, tokenizer.pad_token_id, lr_warmup_steps=0, version=2, **options)
    metrics = core.step(copy.deepcopy(groups))
    grads = torch.cat([p.grad.flatten() for p in learner.parameters()])
    return metrics, grads, learner


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_micro_batches_chunks_and_checkpointing_give_the_one_batch_step(policy, loss):
    groups = groups_of()
    config = LossConfig(name=loss)
    whole, whole_grads, _ = step(policy, groups, loss=config, micro_batch_groups=len(groups), logprob_chunk=0)
    parts, part_grads, _ = step(policy, groups, loss=config, micro_batch_groups=2, micro_batch_tokens=120,
                                         logprob_chunk=3, gradient_checkpointing=True)
    assert parts["loss"] == pytest.approx(whole["loss"], rel=1e-4, abs=1e-6)
    assert parts["kl_penalty"] == pytest.approx(whole["kl_penalty"], rel=1e-4, abs=1e-7)
    assert float(whole_grads.norm()) > 0
    # float rounding only: summation order differs between micro-batches and chunks
    assert float((part_grads - whole_grads).norm() / whole_grads.norm()) < 1e-4


def test_micro_batches_respect_groups_and_tokens():
    groups = groups_of(count=7)
    plan = plan_micro_batches(groups, max_groups=3, max_tokens=150)
    assert [g for batch in plan for g in batch] == groups  # every group once, in order, never split
    for batch in plan:
        rows = sum(g.size for g in batch)
        width = max(len(g.prompt_ids) for g in batch) + max(len(c) for g in batch for c in g.completion_ids)
        assert len(batch) <= 3 and (rows * width <= 150 or len(batch) == 1)
    assert len(plan) > len(plan_micro_batches(groups, max_groups=3, max_tokens=None))  # the token cap splits more
    assert plan_micro_batches(groups, max_groups=3, max_tokens=1) == [[g] for g in groups]  # too big: alone


def test_fresh_groups_report_the_sampler_learner_gap(policy):
    """Groups sampled by the version being stepped from with the policy's own log-probs show a gap of
    ~0; made-up log-probs show a large one (the alarm for a broken weight sync)."""
    from swarm.logprobs import completion_logprobs
    from swarm.rollouts import collate

    model, tokenizer = policy
    groups = [g for g in groups_of() if g.version == 2]
    batch = collate(groups, tokenizer.pad_token_id)
    with torch.no_grad():
        true = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    honest = copy.deepcopy(groups)
    rows = iter(true.tolist())
    for g in honest:
        g.sampler_logprobs = [next(rows)[: len(c)] for c in g.completion_ids]
    assert step(policy, honest)[0]["fresh_logprob_gap"] < 1e-4
    assert step(policy, groups)[0]["fresh_logprob_gap"] > 0.5


def test_bfloat16_steps_keep_float32_master_weights_and_optimizer_state(policy):
    """Mixed precision: forward and backward under bfloat16 autocast, the parameters and AdamW's
    moments in float32; the step follows the float32 step's direction."""
    groups = groups_of()
    full, full_grads, _ = step(policy, groups)
    mixed, mixed_grads, model = step(policy, groups, autocast_dtype=torch.bfloat16)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    assert mixed["loss"] == pytest.approx(full["loss"], rel=0.05, abs=1e-3)
    cosine = torch.nn.functional.cosine_similarity(mixed_grads, full_grads, dim=0)
    assert float(cosine) > 0.95
