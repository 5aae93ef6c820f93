"""Turn a policy (behind a generation backend) and problems into scored rollout groups."""

from __future__ import annotations

from typing import Sequence

from swarm.generation.base import GenerationBackend, SamplingParams
from swarm.rewards import RewardScorer
from swarm.rollouts import RolloutGroup
from swarm.tasks.base import Problem


def produce_rollouts(
    backend: GenerationBackend,
    scorer: RewardScorer,
    problems: Sequence[Problem],
    params: SamplingParams,
    *,
    version: int,
    sampler_id: str,
) -> list[RolloutGroup]:
    """G completions per problem, scored; one RolloutGroup per problem, in order."""
    gens = backend.generate([p.prompt for p in problems], params)
    groups = []
    for problem, gen in zip(problems, gens):
        rewards = scorer.score(gen.texts, [problem.answer] * len(gen.texts))
        groups.append(
            RolloutGroup(
                problem_id=problem.problem_id,
                prompt_ids=gen.prompt_ids,
                completion_ids=gen.completion_ids,
                sampler_logprobs=gen.completion_logprobs,
                rewards=rewards,
                version=version,
                sampler_id=sampler_id,
                answer=problem.answer,
                completion_texts=gen.texts,
                temperature=params.temperature if not params.greedy else 1.0,
                top_k=params.top_k,
                top_p=params.top_p,
            )
        )
    return groups
