"""Turn a policy (behind a generation backend) and problems into scored rollout groups."""

from __future__ import annotations

from typing import Sequence

from swarm.generation.base import Generation, GenerationBackend, SamplingParams
from swarm.rewards import RewardScorer
from swarm.rollouts import RolloutGroup
from swarm.tasks.base import Problem, cut_at_stop


def truncate_at_stop(gen: Generation, tokenizer, stop_strings: Sequence[str]) -> Generation:
    """The generation with each completion's tokens (and log-probs) cut right after the token that
    completes its first stop string, and its text decoded again from what is kept (stop string
    included: scoring cuts it, as the learner does). Engines that stop by themselves (vLLM with
    include_stop_str_in_output) leave nothing to cut; the transformers backend generates on."""
    ids, logprobs, texts = [], [], []
    for tokens, lps, text in zip(gen.completion_ids, gen.completion_logprobs, gen.texts):
        keep = stop_position(tokens, text, tokenizer, stop_strings)
        ids.append(tokens[:keep])
        logprobs.append(lps[:keep])
        texts.append(text if keep == len(tokens) else tokenizer.decode(tokens[:keep], skip_special_tokens=True))
    finished = [f or len(i) < len(t) for f, i, t in zip(gen.finished or [False] * len(ids), ids, gen.completion_ids)]
    return Generation(gen.prompt_ids, ids, logprobs, texts, finished)


def stop_position(tokens: Sequence[int], text: str, tokenizer, stop_strings: Sequence[str]) -> int:
    """How many tokens to keep: up to the one whose decoding first contains a stop string (all of
    them when the text has none). Binary search over prefixes: a prefix's text grows with it."""
    if cut_at_stop(text, stop_strings) == text:
        return len(tokens)
    low, high = 1, len(tokens)  # the smallest prefix that contains a stop string
    while low < high:
        mid = (low + high) // 2
        prefix = tokenizer.decode(tokens[:mid], skip_special_tokens=True)
        if cut_at_stop(prefix, stop_strings) != prefix:
            high = mid
        else:
            low = mid + 1
    return low


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
    if params.stop_strings:
        gens = [truncate_at_stop(gen, backend.tokenizer, params.stop_strings) for gen in gens]
    groups = []
    for problem, gen in zip(problems, gens):
        rewards = scorer.score([cut_at_stop(t, params.stop_strings) for t in gen.texts], [problem.answer] * len(gen.texts))
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
