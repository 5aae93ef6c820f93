"""Per-step gradient and movement diagnostics of a learner step (GitHub issue #19, item 4: why GEPO's
learner drifts further from its samplers than GRPO's); the per-loss metrics are diagnostics.py's.

`StepDiagnostics` collects the measures that need the model: the gradient norms of the positive-
and negative-advantage parts of the loss and of the k3 penalty, the cosine with the previous step's
gradient, the parameter update's size, how far the step moved the log-probs of the batch's own
tokens, and KL(learner || sampler) by each group's staleness. Off by default:
`LearnerCore.step_diagnostics = True` turns them on (benchmarks/gepo_weak_spot.py).

It sits above the loss modules: it computes the configured loss (`compute_loss`) on each sign of
advantage, so every loss must be registered, which importing the package swarm.losses (that this
module belongs to) does before this module runs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from swarm.losses.base import MAX_LOG_RATIO, LossInputs
from swarm.losses.kl import k3_penalty
from swarm.losses.registry import compute_loss


def _flat(grads, params) -> Tensor:
    return torch.cat([(g if g is not None else torch.zeros_like(p)).detach().reshape(-1).float()
                      for g, p in zip(grads, params)])


def _cosine(a: Tensor | None, b: Tensor | None) -> float:
    if a is None or b is None:
        return float("nan")
    denominator = float(a.norm() * b.norm())
    return float(a @ b) / denominator if denominator > 0 else float("nan")


class StepDiagnostics:
    """Collects one learner step's gradient and movement measures; see the module's docstring.

    `micro_batch(...)` before the micro-batch's backward (it takes extra gradients with
    retain_graph), `before_update()` after gradient clipping and before the optimizer step,
    `finish(logprobs_of)` after it; `finish` returns the metrics. `state` carries the previous
    step's gradient and update between steps (a dict the caller keeps).
    """

    def __init__(self, model, loss_config, state: dict) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.config = loss_config
        self.state = state
        self.parts = {"pos": None, "neg": None, "kl": None}
        self.kl_by_staleness: dict[int, list[float]] = {}
        self.logprob_sum = self.logprob_tokens = 0.0
        self.batches: list[tuple] = []

    def _add(self, name: str, loss: Tensor) -> None:
        if not loss.requires_grad:
            return
        grads = torch.autograd.grad(loss, self.params, retain_graph=True, allow_unused=True)
        flat = _flat(grads, self.params)
        self.parts[name] = flat if self.parts[name] is None else self.parts[name] + flat

    def micro_batch(self, inputs, staleness: Tensor, batch_key) -> None:
        """inputs: the micro-batch's LossInputs (learner log-probs with their graph); staleness:
        (B,) steps; batch_key: whatever `finish`'s `logprobs_of` needs to recompute the learner's
        log-probs of this micro-batch after the step."""
        no_kl = self.config.model_copy(update={"beta": 0.0})
        for name, adv in (("pos", inputs.advantages.clamp(min=0)), ("neg", inputs.advantages.clamp(max=0))):
            part = LossInputs(inputs.learner_logprobs, inputs.sampler_logprobs, inputs.mask, adv, inputs.group_ids,
                              inputs.proximal_logprobs)
            self._add(name, compute_loss(part, no_kl).loss)
        if self.config.beta > 0:
            mask = inputs.mask.float()
            self._add("kl", self.config.beta * k3_penalty(inputs.learner_logprobs.float(),
                                                          inputs.sampler_logprobs.float(), mask,
                                                          self.config.max_claimed_log_ratio))
        with torch.no_grad():
            learner = inputs.learner_logprobs.detach().float().clone()  # kept until after the update
            sampler = inputs.sampler_logprobs.detach().float()
            mask = inputs.mask.float()
            log_r = (learner - sampler).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
            per_token = torch.exp(log_r) * log_r * mask  # KL(p || q) estimated on q's tokens
            self.logprob_sum += float((learner * mask).sum())
            self.logprob_tokens += float(mask.sum())
            for s in staleness.unique().tolist():
                rows = staleness == s
                sums = self.kl_by_staleness.setdefault(int(s), [0.0, 0.0])
                sums[0] += float(per_token[rows].sum())
                sums[1] += float(mask[rows].sum())
            self.batches.append((batch_key, learner, mask, inputs.advantages.detach().float()))

    def before_update(self) -> None:
        self.before = torch.cat([p.detach().reshape(-1).float().clone() for p in self.params])
        self.total = _flat([p.grad for p in self.params], self.params)

    def finish(self, logprobs_of) -> dict:
        """logprobs_of(batch_key) -> the updated learner's (B, T) log-probs of that micro-batch."""
        after = torch.cat([p.detach().reshape(-1).float() for p in self.params])
        update = after - self.before
        pos, neg, kl = self.parts["pos"], self.parts["neg"], self.parts["kl"]
        metrics = {
            "grad_norm_pos": float(pos.norm()) if pos is not None else 0.0,
            "grad_norm_neg": float(neg.norm()) if neg is not None else 0.0,
            "grad_norm_kl": float(kl.norm()) if kl is not None else 0.0,
            "grad_cos_pos_neg": _cosine(pos, neg),
            "grad_cos_prev": _cosine(self.total, self.state.get("grad")),
            "update_norm": float(update.norm()),
            "update_cos_prev": _cosine(update, self.state.get("update")),
        }
        self.state["grad"], self.state["update"] = self.total, update
        change = change_pos = change_neg = step_kl = step_k3 = 0.0
        tokens = tokens_pos = tokens_neg = 0.0
        with torch.no_grad():
            for key, before, mask, adv in self.batches:
                now = logprobs_of(key).detach().float()
                delta = (now - before).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO) * mask
                step_kl += float((torch.exp(delta) * delta * mask).sum())
                step_k3 += float(((torch.expm1(-delta) + delta) * mask).sum())
                change += float(delta.sum())
                tokens += float(mask.sum())
                pos, neg = (adv > 0)[:, None].float() * mask, (adv < 0)[:, None].float() * mask
                change_pos += float((delta * pos).sum())
                change_neg += float((delta * neg).sum())
                tokens_pos += float(pos.sum())
                tokens_neg += float(neg.sum())
        metrics.update(
            # KL(new || old) per token on the batch's tokens (E[r log r], r = new / old: can come out
            # below 0), KL(old || new) by k3 (E[1/r - 1 + log r], never below 0), and the mean change of
            # the tokens' log-probs
            step_kl=step_kl / max(tokens, 1.0),
            step_kl_k3=step_k3 / max(tokens, 1.0),
            step_logprob_change=change / max(tokens, 1.0),
            step_logprob_change_pos=change_pos / tokens_pos if tokens_pos else 0.0,
            step_logprob_change_neg=change_neg / tokens_neg if tokens_neg else 0.0,
            # the learner's mean log-prob of the batch's tokens before the step (a cross-entropy: it
            # rises as the policy sharpens)
            learner_logprob_mean=self.logprob_sum / max(self.logprob_tokens, 1.0),
            kl_by_staleness={str(s): (v[0] / v[1] if v[1] else math.nan, v[1])
                             for s, v in sorted(self.kl_by_staleness.items())},
        )
        return metrics
