"""The learner's optimisation step on a list of rollout groups: learning-rate schedule, advantages,
the chosen policy loss, gradient clipping, optimizer step, version bump, and the step's metrics (the
schema of steps.jsonl). No I/O: the swarm learner and the in-process trainer both call it.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import torch

from swarm.advantages import group_advantages
from swarm.logprobs import completion_logprobs
from swarm.config import LossConfig, TrainingSettings, default_of
from swarm.losses import LOSSES, LossInputs, compute_loss
from swarm.rollouts import RolloutGroup, collate

STALENESS_BINS = (0, 1, 2, 4, 8, 16, 32, 64)  # histogram bucket lower edges, in steps


class NonFiniteStep(RuntimeError):
    """The step's loss or gradient norm was not finite; the policy and optimizer were left unchanged."""

    def __init__(self, message: str, metrics: dict) -> None:
        super().__init__(message)
        self.metrics = metrics


def warmup_factor(version: int, warmup_steps: int) -> float:
    """Linear warm-up by policy version: the step from version v uses (v + 1) / warmup_steps of the
    learning rate. By version rather than by a scheduler's own counter, so that a resumed learner
    continues the schedule where it stopped."""
    return min(1.0, (version + 1) / warmup_steps) if warmup_steps else 1.0


def staleness_histogram(staleness: list[int]) -> dict[str, int]:
    edges = list(STALENESS_BINS) + [None]
    hist = {}
    for low, high in zip(edges[:-1], edges[1:]):
        label = f"{low}" if high == low + 1 else (f"{low}-{high - 1}" if high else f"{low}+")
        hist[label] = sum(1 for s in staleness if s >= low and (high is None or s < high))
    return hist


class LearnerCore:
    """Owns the trainable policy and its optimizer; `version` counts optimizer steps.

    learning_rate: AdamW learning rate, warmed up over `lr_warmup_steps` versions.
    max_grad_norm: gradient clipping (<= 0 disables).
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
        learning_rate: float = default_of(TrainingSettings, "learning_rate"),
        lr_warmup_steps: int = default_of(TrainingSettings, "lr_warmup_steps"),
        weight_decay: float = 0.0,
        max_grad_norm: float = default_of(TrainingSettings, "max_grad_norm"),
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
        self.learning_rate, self.lr_warmup_steps = learning_rate, lr_warmup_steps
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay, betas=(0.9, 0.99))
        self.version = version

    @classmethod
    def from_settings(cls, model, pad_token_id: int, settings: TrainingSettings, **kwargs) -> "LearnerCore":
        """The learner for a role's training settings (LearnerConfig or TrainerConfig)."""
        return cls(model, pad_token_id, loss=settings.loss, learning_rate=settings.learning_rate,
                   lr_warmup_steps=settings.lr_warmup_steps, max_grad_norm=settings.max_grad_norm, **kwargs)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def step(self, groups: Sequence[RolloutGroup]) -> dict[str, float]:
        """One optimizer step on `groups`; returns metrics (loss's own plus reward, staleness, ...).
        Raises NonFiniteStep, leaving everything as it was, when the loss or gradient is not finite."""
        if not groups:
            raise ValueError("a learner step needs at least one rollout group")
        sampling = {(g.temperature, g.top_k, g.top_p) for g in groups}
        if len(sampling) > 1:
            raise ValueError(f"rollout groups were sampled with different settings {sorted(sampling)}; step on them separately")
        temperature, top_k, top_p = sampling.pop()
        started = time.time()
        learning_rate = self.learning_rate * warmup_factor(self.version, self.lr_warmup_steps)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = learning_rate
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
        if not (math.isfinite(sums.get("loss", 0.0)) and math.isfinite(float(grad_norm))):
            # AdamW would write NaN into every parameter, and the next version would carry it
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteStep(f"step from version {self.version}: loss {sums.get('loss')}, gradient norm {float(grad_norm)}; "
                                "skipped", {**sums, "grad_norm": float(grad_norm)})
        self.optimizer.step()
        staleness = [self.version - g.version for g in groups]
        rewards = [r for g in groups for r in g.rewards if r is not None]
        self.version += 1
        sums.update(
            grad_norm=float(grad_norm),
            learning_rate=learning_rate,
            reward_mean=sum(rewards) / len(rewards) if rewards else float("nan"),
            accuracy=sum(r >= 0.5 for r in rewards) / max(len(rewards), 1),
            staleness_mean=sum(staleness) / len(staleness),
            staleness_min=min(staleness),
            staleness_max=float(max(staleness)),
            staleness_hist=staleness_histogram(staleness),
            groups=float(len(groups)),
            completion_tokens=float(sum(g.num_tokens() for g in groups)),
            version=float(self.version),
            step=self.version,
            optimizer_seconds=time.time() - started,
        )
        return sums
