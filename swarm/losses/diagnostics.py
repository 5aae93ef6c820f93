"""Diagnostics of what a clipped objective does with each sign of advantage (GitHub issue #19,
item 4: why GEPO's learner drifts further from its samplers than GRPO's).

Two kinds, both detached and cheap:

- Per-loss metrics (`sign_split_metrics`, `gepo_weight_metrics`), returned with every step's loss
  metrics. Shares are of the whole micro-batch (sequences for sequence- and group-level weights,
  tokens for token-level ones), so that they add up across micro-batches and
  `clip_frac == clip_frac_pos + clip_frac_neg`; the clip fraction among positive-advantage elements
  is `clip_frac_pos / adv_pos_frac` (a ratio of sums over steps in a report).
- `StepDiagnostics`: per-step gradient and movement measures that need the model (the gradient
  norms of the positive- and negative-advantage parts of the loss and of the k3 penalty, the
  cosine with the previous step's gradient, the parameter update's size, how far the step moved the
  log-probs of the batch's own tokens, and KL(learner || sampler) by each group's staleness). Off by
  default: `LearnerCore.step_diagnostics = True` turns them on (benchmarks/gepo_weak_spot.py).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from swarm.losses.base import MAX_LOG_RATIO


@torch.no_grad()
def sign_split_metrics(clipped: Tensor, coefficient: Tensor, advantages: Tensor, weight: Tensor) -> dict[str, Tensor]:
    """How clipping and the gradient divide between positive and negative advantages.

    clipped: float mask of the elements whose clipped branch was taken (no gradient);
    coefficient: each element's gradient coefficient on its log-prob term (weight * A where the
    objective was not clipped, 0 where it was), the same shape;
    advantages: (B,) per sequence; weight: which elements count (valid sequences (B,), or the token
    mask (B, T), in which case a token's coefficient also carries its sequence's 1/length when the
    loss averages over a sequence's tokens - pass it so).

    Returns adv_pos_frac / adv_neg_frac (share of elements with A > 0 / A < 0), clip_frac_pos /
    clip_frac_neg (share of all elements that are clipped and have A > 0 / A < 0), coef_pos_share
    (share of the total |coefficient| from A > 0) and coef_net (sum of coefficients over the sum of
    their magnitudes: 0 when the pushes up and down balance, > 0 when the update raises the
    log-probs of the batch's own completions on balance).
    """
    adv = advantages if clipped.dim() == 1 else advantages[:, None].expand_as(clipped)
    weight = weight.float()
    pos, neg = (adv > 0).float() * weight, (adv < 0).float() * weight
    total = weight.sum().clamp(min=1e-12)
    magnitude = coefficient.abs() * weight
    mass = magnitude.sum()
    return {
        "adv_pos_frac": pos.sum() / total,
        "adv_neg_frac": neg.sum() / total,
        "clip_frac_pos": (clipped * pos).sum() / total,
        "clip_frac_neg": (clipped * neg).sum() / total,
        # no coefficient at all: both numerators are 0 as well, so the clamp makes them 0 without a host sync
        "coef_pos_share": (magnitude * pos).sum() / mass.clamp(min=1e-12),
        "coef_net": (coefficient * weight).sum() / mass.clamp(min=1e-12),
    }


@torch.no_grad()
def token_escape_metrics(inputs, clipped: Tensor, eps_low: float, eps_high: float) -> dict[str, Tensor]:
    """For a sequence-level clip: the tokens whose own ratio r_t = p_t / q_t is past the clip range in
    the direction PPO stops (A > 0 and r_t > 1 + eps_high, or A < 0 and r_t < 1 - eps_low) while their
    sequence is not clipped, so that they keep being pushed further. A token-level clip (GRPO) drops
    exactly these. token_escape_pos / token_escape_neg: shares of all tokens, by sign of advantage
    (they add up to token_escape_frac)."""
    mask = inputs.mask.float()
    log_r = (inputs.learner_logprobs - inputs.sampler_logprobs).detach().float()
    adv = inputs.advantages[:, None]
    up = (adv > 0) & (log_r > math.log1p(eps_high))
    down = (adv < 0) & (log_r < (math.log(1 - eps_low) if eps_low < 1 else -math.inf))
    live = (1 - clipped.float())[:, None] * mask
    total = mask.sum().clamp(min=1)
    pos, neg = (up.float() * live).sum() / total, (down.float() * live).sum() / total
    return {"token_escape_frac": pos + neg, "token_escape_pos": pos, "token_escape_neg": neg}


@torch.no_grad()
def gepo_weight_metrics(learner_seq: Tensor, sampler_seq: Tensor, log_expectation: Tensor, clipped: Tensor,
                        advantages: Tensor, valid: Tensor, eps_low: float, eps_high: float) -> dict[str, Tensor]:
    """GEPO's weight w = p / E_q[q] split into its two factors, w = rho * w0, with rho = p / q the
    sequence's own ratio (how far the learner moved from the sampler on it) and w0 = q / E_q[q] the
    weight the sequence would have on-policy (p = q): w0 is not 1, its mean over a group is
    (sum q)^2 / (G sum q^2) <= 1, and the PPO clip acts on w, so it is centred on E_q[q], not on q.

    Returns (over valid sequences):
    - gepo_w0_mean, gepo_w0_sd: mean and standard deviation of w0;
    - gepo_w0_adv: mean of w0 * A, the net push of the on-policy weight (0 for a weight of 1, since
      advantages sum to 0 in a group; > 0 when the completions with positive advantage are the more
      likely ones);
    - gepo_w0_out: share of sequences whose w0 is already outside [1 - eps_low, 1 + eps_high];
    - seq_log_ratio_abs: mean |log rho| (per token in "mean" mode);
    - trust_escape_frac: share of sequences whose objective is not clipped although their own ratio
      rho is past the clip range in the direction PPO would stop (A > 0 and rho > 1 + eps_high, or
      A < 0 and rho < 1 - eps_low): they keep pushing away from their sampler;
    - clip_by_bias_frac: share clipped although rho is inside the clip range (clipped by w0 alone).
    """
    log_rho = (learner_seq - sampler_seq).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    log_w0 = (sampler_seq - log_expectation).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    w0 = torch.exp(log_w0.double())
    rho = torch.exp(log_rho.double())
    valid = valid.double()
    n = valid.sum().clamp(min=1)
    w0_mean = (w0 * valid).sum() / n
    w0_sd = torch.sqrt((((w0 - w0_mean) ** 2) * valid).sum() / n)
    adv = advantages.double()
    beyond = ((adv > 0) & (rho > 1 + eps_high)) | ((adv < 0) & (rho < 1 - eps_low))
    inside = (rho >= 1 - eps_low) & (rho <= 1 + eps_high)
    clipped = clipped.double()
    out = ((w0 < 1 - eps_low) | (w0 > 1 + eps_high)).double()
    metrics = {
        "gepo_w0_mean": w0_mean,
        "gepo_w0_sd": w0_sd,
        "gepo_w0_adv": (w0 * adv * valid).sum() / n,
        "gepo_w0_out": (out * valid).sum() / n,
        "seq_log_ratio_abs": (log_rho.double().abs() * valid).sum() / n,
        "trust_escape_frac": (beyond.double() * (1 - clipped) * valid).sum() / n,
        "clip_by_bias_frac": (inside.double() * clipped * valid).sum() / n,
    }
    return {k: v.float() for k, v in metrics.items()}


# ----------------------------------------------------------------------------------------------
# Per-step gradient and movement diagnostics (need the model)


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
        from swarm.losses import LossInputs, compute_loss
        from swarm.losses.kl import k3_penalty

        no_kl = self.config.model_copy(update={"beta": 0.0})
        for name, adv in (("pos", inputs.advantages.clamp(min=0)), ("neg", inputs.advantages.clamp(max=0))):
            part = LossInputs(inputs.learner_logprobs, inputs.sampler_logprobs, inputs.mask, adv, inputs.group_ids,
                              inputs.proximal_logprobs)
            self._add(name, compute_loss(part, no_kl).loss)
        if self.config.beta > 0:
            mask = inputs.mask.float()
            self._add("kl", self.config.beta * k3_penalty(inputs.learner_logprobs.float(),
                                                          inputs.sampler_logprobs.float(), mask))
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
