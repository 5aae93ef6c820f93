"""The GEPO paper's diagnostic of stale rollouts: how far an importance-weighted estimate of the
expected advantage under the learner's policy p, built from a group sampled by a stale policy q,
lands from the truth (paper, Theorem 2 and Figure 12: Bias = |E_p[A] - E_q[w A]|).

For one group: A(y) = (r(y) - mean_q r) / std_q r, the group's own advantage function. The truth
E_p[A] is estimated from fresh completions of the same prompt sampled from p (the learner's current
policy), scored with the same reward; the importance-weighted estimates use the group's G
completions with three weights:
- gepo:  p(y) / E_q[q],  E_q[q] estimated within the group as sum q^2 / sum q (sequence probabilities);
- seq:   p(y) / q(y) (the sequence-level ratio);
- token: the mean over tokens of p(y_t) / q(y_t) (the token-level ratio, as GRPO weights tokens).
Errors are averaged over the groups whose rewards are not all equal (A is 0 otherwise). The
fresh-sample truth has its own noise (about std(A) / sqrt(M)), the same for every estimator.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from swarm.config import GenerationSettings, default_of
from swarm.generation import SamplingParams
from swarm.logprobs import completion_logprobs
from swarm.rollouts import collate

LOG_RATIO_CLAMP = 20.0  # as in the losses: exp stays finite for long sequences


def importance_weights(learner_lp: torch.Tensor, sampler_lp: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-completion weights of one group (tensors [G, T]; mask 1 on completion tokens)."""
    p_seq = (learner_lp * mask).sum(-1).double()
    q_seq = (sampler_lp * mask).sum(-1).double()
    log_eq_q = torch.logsumexp(2 * q_seq, 0) - torch.logsumexp(q_seq, 0)
    token_ratio = torch.exp((learner_lp - sampler_lp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).double() * mask
    return {
        "gepo": torch.exp((p_seq - log_eq_q).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)),
        "seq": torch.exp((p_seq - q_seq).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)),
        "token": token_ratio.sum(-1) / mask.sum(-1).clamp(min=1),
    }


@torch.no_grad()
def expected_advantage_errors(model, backend, scorer, groups: Sequence, problems: dict, pad_token_id: int, *,
                              fresh_samples: int = 16,
                              max_new_tokens: int = default_of(GenerationSettings, "max_completion_length")) -> dict[str, float]:
    """{"adv_err_gepo", "adv_err_seq", "adv_err_token", "adv_groups"} for `groups` (rollouts of one
    sampling setting) against fresh samples from `model` (the learner's current policy, wrapped by
    `backend`)."""
    eligible = []
    for group in groups:
        rewards = [r for r in group.rewards if r is not None]
        if len(rewards) != group.size or group.size < 2:
            continue
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
        if std > 1e-6:  # all-equal rewards: every advantage is 0, nothing to estimate
            eligible.append((group, mean, std))
    errors: dict[str, list[float]] = {"gepo": [], "seq": [], "token": []}
    if eligible:
        first = eligible[0][0]
        params = SamplingParams(num_completions=fresh_samples, temperature=first.temperature, top_k=first.top_k,
                                top_p=first.top_p, max_new_tokens=max_new_tokens)
        generated = backend.generate([problems[g.problem_id].prompt for g, _, _ in eligible], params)
        batch = collate([g for g, _, _ in eligible], pad_token_id)
        learner = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                                      temperature=first.temperature, top_k=first.top_k, top_p=first.top_p)
        mask = batch.completion_mask.to(learner.dtype)
        sampler = batch.sampler_logprobs.to(learner.dtype)
        row = 0
        for (group, mean, std), gen in zip(eligible, generated):
            rows = slice(row, row + group.size)
            row += group.size
            fresh = [r for r in scorer.score(gen.texts, [problems[group.problem_id].answer] * len(gen.texts)) if r is not None]
            if not fresh:
                continue
            truth = sum((r - mean) / std for r in fresh) / len(fresh)
            advantages = torch.tensor([(r - mean) / std for r in group.rewards], dtype=torch.float64)
            for name, w in importance_weights(learner[rows], sampler[rows], mask[rows]).items():
                errors[name].append(abs(float((w * advantages).mean()) - truth))
    out = {f"adv_err_{k}": (sum(v) / len(v) if v else float("nan")) for k, v in errors.items()}
    out["adv_groups"] = float(len(errors["gepo"]))
    return out
