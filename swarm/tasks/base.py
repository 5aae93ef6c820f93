"""What a task is: a sequence of problems (prompt text + gold answer), split across samplers."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol, Sequence

BOXED_INSTRUCTION = "Put the final answer in \\boxed{}."
DEFAULT_TEMPLATE = "{question}\n" + BOXED_INSTRUCTION.replace("{}", "{{}}")


def build_prompt(question: str, tokenizer=None, template: str = DEFAULT_TEMPLATE) -> str:
    """The text a policy sees: the template filled in, wrapped in the tokenizer's chat template
    when it has one (instruction-tuned models expect it)."""
    text = template.format(question=question)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    return text


@dataclass(frozen=True)
class Problem:
    problem_id: str  # stable across peers: rollouts name the problem they answer
    question: str  # raw question text
    answer: str  # gold answer, in a form math-verify parses ("68", "\\frac{1}{2}", "0.5")
    prompt: str  # the text the policy sees (template applied)


class Task(Protocol):
    name: str

    def problems(self, split: str = "train") -> Sequence[Problem]: ...


def shard_for_sampler(problems: Sequence[Problem], sampler_id: str, num_shards: int | None = None) -> list[Problem]:
    """Deterministic share of the problems for one sampler.

    With `num_shards`, the problems are split into that many disjoint shards and the sampler takes
    the one its id hashes to; without, every sampler sees all problems in its own seeded order (so
    two samplers rarely work on the same prompt at the same time)."""
    digest = int(hashlib.sha256(sampler_id.encode()).hexdigest(), 16)
    if num_shards:
        shard = digest % num_shards
        return [p for i, p in enumerate(problems) if i % num_shards == shard]
    import random

    order = list(problems)
    random.Random(digest).shuffle(order)
    return order
