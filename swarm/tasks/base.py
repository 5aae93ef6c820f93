"""What a task is: a sequence of problems (prompt text + gold answer), split across samplers."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol, Sequence

from swarm.config import TaskSettings, default_of

QUESTION_SLOT = "{question}"
# Filled by plain replacement, not str.format: a template may hold LaTeX braces (\boxed{}) as written.
DEFAULT_TEMPLATE: str = default_of(TaskSettings, "prompt_template")
# What a task's problems(split) accepts: every row, the part to train on, the held-out part.
SPLITS = ("all", "train", "test")


def check_template(template: str) -> str:
    """A prompt template must say where the question goes."""
    if QUESTION_SLOT not in template:
        raise ValueError(f"prompt template must contain '{QUESTION_SLOT}' where the question goes, got {template!r}")
    return template


def truncate_prompt(prompt: str, tokenizer, max_prompt_length: int | None) -> str:
    """`prompt` cut to its last `max_prompt_length` tokens, as TRL's GRPOTrainer cuts prompts (from the
    left, decoded back to text with the special tokens kept); unchanged when it fits or no limit is
    set. Special tokens the tokenizer adds by itself (a BOS) are not counted. Every peer builds its
    prompts through this, so the learner checks what samplers generate from."""
    if max_prompt_length is None:
        return prompt
    if tokenizer is None:
        raise ValueError("--max-prompt-length counts the policy's tokens: it needs the policy's tokenizer")
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_prompt_length:
        return prompt
    return tokenizer.decode(ids[-max_prompt_length:], skip_special_tokens=False)


def build_prompt(question: str, tokenizer=None, template: str = DEFAULT_TEMPLATE, *, system_prompt: str | None = None,
                 apply_chat_template: bool = True, max_prompt_length: int | None = None) -> str:
    """The text a policy sees: the template filled in, wrapped in the tokenizer's chat template
    when it has one and `apply_chat_template` (instruction-tuned models expect it), then cut to
    `max_prompt_length` tokens from the left (truncate_prompt). Without a chat template, a system
    prompt goes before the text, separated by a blank line."""
    return truncate_prompt(_full_prompt(question, tokenizer, template, system_prompt=system_prompt,
                                        apply_chat_template=apply_chat_template), tokenizer, max_prompt_length)


def _full_prompt(question: str, tokenizer, template: str, *, system_prompt: str | None, apply_chat_template: bool) -> str:
    text = check_template(template).replace(QUESTION_SLOT, question)
    if apply_chat_template and tokenizer is not None and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [{"role": "user", "content": text}]
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001  jinja raises its own types (a template without a system role)
            raise ValueError(f"the tokenizer's chat template cannot build a prompt ({exc}); drop --system-prompt "
                             "or use --no-apply-chat-template") from exc
    return f"{system_prompt}\n\n{text}" if system_prompt else text


def cut_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """`text` up to the first occurrence of any stop string (the stop string itself dropped), as a
    completion is scored: what a policy writes after a stop string is not part of its answer."""
    cut = min((i for i in (text.find(s) for s in stop_strings if s) if i >= 0), default=len(text))
    return text[:cut]


@dataclass(frozen=True)
class Problem:
    problem_id: str  # stable across peers: rollouts name the problem they answer
    question: str  # raw question text
    answer: str  # gold answer, in a form math-verify parses ("68", "\\frac{1}{2}", "0.5")
    prompt: str  # the text the policy sees (template applied)


class Task(Protocol):
    name: str
    stop_strings: tuple[str, ...]  # completions are cut at the first of these before scoring
    eval_split: str  # the split `swarm eval` reads unless told: "test" or "all"

    def problems(self, split: str = "train") -> Sequence[Problem]: ...

    def skipped_rows(self, split: str) -> int:
        """Rows of `split` left out for want of a question or a gold answer."""
        ...

    def describe_split(self, split: str) -> str:
        """What `split` is, in words ("every row of gsm.jsonl", "the test split of openai/gsm8k")."""
        ...


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
