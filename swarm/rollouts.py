"""Rollout groups: one prompt, its G completions, the sampler's log-probs and rewards, and the
policy version that generated them; and `collate`, which pads a list of groups into tensors.

This is the in-memory form; the wire form (with bounds and validation of peer data) lives with
the transport.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass
class RolloutGroup:
    problem_id: str
    prompt_ids: list[int]
    completion_ids: list[list[int]]  # G completions, each ending with EOS when finished
    sampler_logprobs: list[list[float]]  # per completion token, under the sampling distribution
    rewards: list[float | None]  # None: the sampler could not score that completion
    version: int  # policy version that generated the completions
    sampler_id: str
    answer: str = ""  # gold answer the rewards were scored against
    completion_texts: list[str] = field(default_factory=list)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    created_at: float = field(default_factory=time.time)  # seconds since the epoch
    sender: str = ""  # the transport-authenticated peer it came from (set on receipt, not sent)

    @property
    def size(self) -> int:
        return len(self.completion_ids)

    def num_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)


@dataclass
class Batch:
    prompt_ids: torch.Tensor  # (B, Tp) left-padded
    prompt_mask: torch.Tensor  # (B, Tp)
    completion_ids: torch.Tensor  # (B, Tc) right-padded
    completion_mask: torch.Tensor  # (B, Tc) float
    sampler_logprobs: torch.Tensor  # (B, Tc)
    rewards: torch.Tensor  # (B,) float, NaN where missing
    group_ids: torch.Tensor  # (B,) index of the group in the list given to `collate`
    versions: torch.Tensor  # (B,) generating policy version


def collate(groups: Sequence[RolloutGroup], pad_id: int) -> Batch:
    prompts = [g.prompt_ids for g in groups for _ in range(g.size)]
    completions = [c for g in groups for c in g.completion_ids]
    logprobs = [lp for g in groups for lp in g.sampler_logprobs]
    tp = max(len(p) for p in prompts)
    tc = max(1, max(len(c) for c in completions))
    b = len(completions)
    prompt_ids = torch.full((b, tp), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((b, tp), dtype=torch.long)
    completion_ids = torch.full((b, tc), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((b, tc))
    sampler = torch.zeros((b, tc))
    for i, (p, c, lp) in enumerate(zip(prompts, completions, logprobs)):
        prompt_ids[i, tp - len(p):] = torch.tensor(p, dtype=torch.long)
        prompt_mask[i, tp - len(p):] = 1
        if c:
            completion_ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
            completion_mask[i, : len(c)] = 1
            sampler[i, : len(c)] = torch.tensor(lp)
    rewards = torch.tensor([math.nan if r is None else float(r) for g in groups for r in g.rewards])
    group_ids = torch.tensor([gi for gi, g in enumerate(groups) for _ in range(g.size)])
    versions = torch.tensor([g.version for g in groups for _ in range(g.size)])
    return Batch(prompt_ids, prompt_mask, completion_ids, completion_mask, sampler, rewards, group_ids, versions)
