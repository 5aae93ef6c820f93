"""The learner's optimisation step on a list of rollout groups: advantages, the chosen policy loss,
gradient clipping, optimizer step, version bump. No I/O: peers and the staleness harness call it.
"""

from __future__ import annotations

from typing import Sequence

import torch

from swarm.advantages import group_advantages
from swarm.logprobs import completion_logprobs
from swarm.losses import LOSSES, LossConfig, LossInputs, compute_loss
from swarm.rollouts import RolloutGroup, collate


class LearnerCore:
    """Owns the trainable policy and its optimizer; `version` counts optimizer steps.

    lr: AdamW learning rate. max_grad_norm: gradient clipping (<= 0 disables).
    micro_batch_groups: groups per forward/backward (gradients accumulate across micro-batches; a
    group is never split, since GEPO's expectation is taken over a whole group).
    advantage_mode: None takes the loss's own (std for GRPO/GEPO, no_std for Dr.GRPO, beta for BNPO).
    """

    def __init__(
        self,
        model,
        pad_token_id: int,
        *,
        loss: LossConfig | None = None,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        micro_batch_groups: int = 16,
        advantage_mode: str | None = None,
        version: int = 0,
    ) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.loss = loss or LossConfig()
        self.advantage_mode = advantage_mode or LOSSES[self.loss.name].advantage_mode
        self.max_grad_norm = max_grad_norm
        self.micro_batch_groups = micro_batch_groups
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99))
        self.version = version

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def step(self, groups: Sequence[RolloutGroup]) -> dict[str, float]:
        """One optimizer step on `groups`; returns metrics (loss's own plus reward, staleness, ...)."""
        if not groups:
            raise ValueError("a learner step needs at least one rollout group")
        sampling = {(g.temperature, g.top_k, g.top_p) for g in groups}
        if len(sampling) > 1:
            raise ValueError(f"rollout groups were sampled with different settings {sorted(sampling)}; step on them separately")
        temperature, top_k, top_p = sampling.pop()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_seqs = sum(g.size for g in groups)
        sums: dict[str, float] = {}
        for start in range(0, len(groups), self.micro_batch_groups):
            chunk = groups[start : start + self.micro_batch_groups]
            batch = collate(chunk, self.pad_token_id)
            dev = self.device
            # advantages per group only need the group's own rewards, so chunking does not change them
            adv = group_advantages(batch.rewards, batch.group_ids, self.advantage_mode)
            learner = completion_logprobs(
                self.model, batch.prompt_ids.to(dev), batch.prompt_mask.to(dev), batch.completion_ids.to(dev),
                batch.completion_mask.to(dev), temperature=temperature, top_k=top_k, top_p=top_p,
            )
            out = compute_loss(
                LossInputs(learner, batch.sampler_logprobs.to(dev), batch.completion_mask.to(dev), adv.to(dev), batch.group_ids.to(dev)),
                self.loss,
            )
            share = batch.completion_ids.size(0) / total_seqs
            (out.loss * share).backward()
            for k, v in out.metrics_as_floats().items():
                sums[k] = sums.get(k, 0.0) + v * share
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.max_grad_norm if self.max_grad_norm > 0 else float("inf")
        )
        self.optimizer.step()
        staleness = [self.version - g.version for g in groups]
        rewards = [r for g in groups for r in g.rewards if r is not None]
        self.version += 1
        sums.update(
            grad_norm=float(grad_norm),
            reward_mean=sum(rewards) / len(rewards) if rewards else float("nan"),
            staleness_mean=sum(staleness) / len(staleness),
            staleness_max=float(max(staleness)),
            groups=float(len(groups)),
            completion_tokens=float(sum(g.num_tokens() for g in groups)),
            version=float(self.version),
        )
        return sums
