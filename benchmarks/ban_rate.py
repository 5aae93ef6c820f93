"""False bans of honest samplers, and how soon liars are banned, under the learner's ban rule
(swarm.verification: a group over the tolerance is refused; a sender with `verify_ban_after` such
groups among its last `verify_ban_window` checked groups is banned; each group is checked with
probability `verify_fraction`, drawn from the OS's randomness). Issue 45.

Honest gaps are real numerics, not an invented distribution: the embedded policy samples
completions at the run's default settings (float32), then their log-probs are computed by the same
policy in bfloat16 and in float16 (what a reduced-precision sampler reports) and in float32 (what
the learner recomputes), with the project's `completion_logprobs`. Every honest group is checked
(fraction 1, the harshest case for an honest sampler) and run through the ban rule.

Liars: the bf16 / fp16 claims moved by 0.2 per token (the brief's "gap of 0.2 or more"), run
through the rule at the default check rate with SystemRandom draws, many times over: how many of
its groups (and of its checked groups) go by before the ban, for a liar lying in every group and
for one lying in every k-th group only (whatever it knows, it cannot know which groups are checked).

And the step a lying group steers when no check picks it (issue 45, attack 9): one group of
wrong answers claiming log-prob 0 among 8, the cosine of the default loss's gradient with the 7
honest groups' gradient, with the KL clamp of 20 nats (before) and the default 2 (after).

`python -m benchmarks ban_rate`; GEPO_BAN_RATE_PROMPTS (default 1300: 10,400 completions) and
GEPO_BAN_RATE_TRIALS (default 20000) make it smaller for a quick run.
"""

from __future__ import annotations

import copy
import math
import os
import random
import statistics
import time

import torch

from benchmarks.common import markdown_table, write_result
from swarm.config import GenerationSettings, LearnerConfig, LossConfig, default_of
from swarm.generation import SamplingParams, make_backend
from swarm.logprobs import completion_logprobs
from swarm.model.loading import load_policy
from swarm.rollouts import RolloutGroup, collate
from swarm.tasks import load_problems
from swarm.training import LearnerCore
from swarm.verification import GapEvidence, completion_gaps

LIE = 0.2
LIE_EVERY = (1, 2, 4, 8)  # a liar lying in every k-th of its groups, honest in the others
WITHIN_GROUPS, WITHIN_CHECKED = 16, 8  # the goals: banned within 16 of its lying groups (99%), 8 checked ones


def sampler_logprobs(model, groups: list[RolloutGroup], pad_id: int, *, per_batch: int = 16) -> list[list[list[float]]]:
    """Per group, per completion, `model`'s log-probs of the completion tokens (no grad)."""
    out = []
    g0 = groups[0]
    with torch.no_grad():
        for start in range(0, len(groups), per_batch):
            chunk = groups[start : start + per_batch]
            batch = collate(chunk, pad_id)
            lp = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                                     temperature=g0.temperature, top_k=g0.top_k, top_p=g0.top_p).float().tolist()
            row = 0
            for g in chunk:
                out.append([lp[row + i][: len(c)] for i, c in enumerate(g.completion_ids)])
                row += g.size
    return out


def gaps_of(claimed: list[list[float]], recomputed: list[list[float]]) -> list[float]:
    """The verifier's per-completion statistic (completion_gaps): mean absolute gap over each
    completion's tokens; a group's gap is the largest of these."""
    width = max(1, max(len(c) for c in claimed))

    def padded(rows):
        return torch.tensor([r + [0.0] * (width - len(r)) for r in rows])

    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in claimed])
    return completion_gaps(padded(claimed), padded(recomputed), mask).tolist()


def run_rule(gaps: list[float], *, fraction: float, tolerance: float, ban_after: int, window: int, rng) -> tuple[int, int] | None:
    """(groups sent, groups checked) when the sender is banned, or None if never."""
    evidence, checked = GapEvidence(ban_after=ban_after, window=window), 0
    for sent, gap in enumerate(gaps, start=1):
        if rng.random() < fraction:
            checked += 1
            if evidence.record("sender", gap > tolerance):
                return sent, checked
    return None


def steering(model, tokenizer, groups: list[RolloutGroup]) -> dict:
    """Cosine of the default loss's gradient on 7 honest groups + 1 q = 1 liar with the 7 honest alone."""
    honest = []
    for g in groups[:7]:
        g = copy.deepcopy(g)
        g.rewards = [1.0] + [0.0] * (g.size - 1)  # a non-zero advantage in every group
        honest.append(g)
    wrong = tokenizer("\\boxed{x^2 + 7}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    liar = RolloutGroup(problem_id="liar", prompt_ids=groups[7].prompt_ids, completion_ids=[wrong] * 8,
                        sampler_logprobs=[[0.0] * len(wrong)] * 8, rewards=[0.0] * 8, version=0, sampler_id="liar")

    def gradient(batch, loss):
        learner = copy.deepcopy(model)
        LearnerCore(learner, tokenizer.pad_token_id, loss=loss, max_grad_norm=0.0).step([copy.deepcopy(g) for g in batch])
        return torch.cat([p.grad.flatten() for p in learner.parameters() if p.grad is not None])

    out = {}
    for label, loss in (("kl clamp 20 (before)", LossConfig(max_claimed_log_ratio=20.0)), ("kl clamp 2 (default)", LossConfig())):
        reference, with_liar = gradient(honest, loss), gradient(honest + [liar], loss)
        out[label] = {"cosine_with_honest_step": float(torch.nn.functional.cosine_similarity(with_liar, reference, dim=0)),
                      "honest_step_norm": float(reference.norm()), "step_norm_with_liar": float(with_liar.norm()),
                      "liar_group_gradient_norm": float(gradient([liar], loss).norm()),
                      "largest_honest_group_gradient_norm": max(float(gradient([g], loss).norm()) for g in honest)}
    return out


def run(num_prompts: int | None = None, trials: int | None = None) -> dict:
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    num_prompts = num_prompts or int(os.environ.get("GEPO_BAN_RATE_PROMPTS", 1300))
    trials = trials or int(os.environ.get("GEPO_BAN_RATE_TRIALS", 20000))
    fraction, tolerance = default_of(LearnerConfig, "verify_fraction"), default_of(LearnerConfig, "verify_tolerance")
    ban_after, window = default_of(LearnerConfig, "verify_ban_after"), default_of(LearnerConfig, "verify_ban_window")
    gen = GenerationSettings()

    learner, tokenizer = load_policy("embedded", dtype="float32")
    learner.eval()
    pad = tokenizer.pad_token_id
    problems = load_problems("arithmetic", {}, tokenizer=tokenizer)[:num_prompts]
    params = SamplingParams(num_completions=gen.num_generations, temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p,
                            max_new_tokens=gen.max_completion_length, seed=1)
    gens = make_backend("transformers", "embedded", dtype="float32").generate([p.prompt for p in problems], params)
    groups = [RolloutGroup(p.problem_id, g.prompt_ids, g.completion_ids, g.completion_logprobs, [0.0] * len(g.texts), 0, "bench",
                           temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p) for p, g in zip(problems, gens)]
    recomputed = sampler_logprobs(learner, groups, pad)
    completions = sum(g.size for g in groups)
    print(f"  {len(groups)} groups, {completions} completions sampled", flush=True)

    honest, liars = {}, {}
    rng = random.SystemRandom()
    for dtype in ("bfloat16", "float16"):
        sampler, _ = load_policy("embedded", dtype=dtype)
        sampler.eval()
        claims = sampler_logprobs(sampler, groups, pad)
        del sampler
        per_group = [gaps_of(c, r) for c, r in zip(claims, recomputed)]
        gaps = [max(g) for g in per_group]
        per_completion = [x for g in per_group for x in g]
        banned = run_rule(gaps, fraction=1.0, tolerance=tolerance, ban_after=ban_after, window=window, rng=rng)
        over = sum(g > tolerance for g in gaps)
        honest[dtype] = {"groups_checked": len(gaps), "completions_checked": len(per_completion),
                         "gap_max": max(per_completion), "gap_p999": sorted(per_completion)[int(0.999 * len(per_completion))],
                         "gap_median": statistics.median(per_completion), "groups_over_tolerance": over,
                         "false_bans": 0 if banned is None else 1,
                         # an honest sampler exceeding with p is banned in a window with probability <= C(window, 2) p^2;
                         # p bounded by the rule of three (95%) when no group exceeded
                         "p_over_bound_95": (over or 3) / len(gaps),
                         "window_ban_bound": math.comb(window, ban_after) * ((over or 3) / len(gaps)) ** ban_after}
        print(f"  honest {dtype}: gap max {honest[dtype]['gap_max']:.4g}, {over} groups over {tolerance}, "
              f"false bans {honest[dtype]['false_bans']}", flush=True)

        for every in LIE_EVERY:
            lying_gaps = [max(gaps_of([[x + LIE for x in row] for row in c], r)) for c, r in zip(claims, recomputed)]
            sent_until, lies_until, checked_until, unbanned = [], [], [], 0
            for _ in range(trials):
                order = rng.sample(range(len(groups)), k=min(len(groups), WITHIN_GROUPS * every * 4))
                stream = [lying_gaps[i] if n % every == 0 else gaps[i] for n, i in enumerate(order)]
                found = run_rule(stream, fraction=fraction, tolerance=tolerance, ban_after=ban_after, window=window, rng=rng)
                if found is None:
                    unbanned += 1
                    continue
                sent, checked = found
                sent_until.append(sent)
                lies_until.append(math.ceil(sent / every))
                checked_until.append(checked)
            within = sum(n <= WITHIN_GROUPS for n in lies_until) / trials
            liars[f"{dtype}, lies in 1 of {every}"] = {
                "base": dtype, "lie_every": every, "lying_gap_min": min(lying_gaps), "trials": trials,
                "banned_within_16_lying_groups": within, "lying_groups_p50": statistics.median(lies_until),
                "lying_groups_p99": sorted(lies_until)[int(0.99 * len(lies_until)) - 1] if lies_until else None,
                "checked_groups_max": max(checked_until) if checked_until else None, "never_banned": unbanned}
            print(f"  liar {dtype} 1/{every}: banned within 16 lying groups {within:.4f}, checked max "
                  f"{liars[f'{dtype}, lies in 1 of {every}']['checked_groups_max']}", flush=True)

    steer = steering(learner, tokenizer, groups)
    analytic = (1 - fraction) ** WITHIN_GROUPS + WITHIN_GROUPS * fraction * (1 - fraction) ** (WITHIN_GROUPS - 1)
    figures = {
        "settings": {"verify_fraction": fraction, "verify_tolerance": tolerance, "verify_ban_after": ban_after,
                     "verify_ban_window": window, "lie": LIE, "num_generations": gen.num_generations,
                     "max_completion_length": gen.max_completion_length},
        "analytic_p_liar_unbanned_after_16": analytic if ban_after == 2 else None,
        "honest": honest, "liars": liars, "steering": steer,
        "goals": {"no_false_ban_over_10000_completions": all(h["false_bans"] == 0 and h["completions_checked"] >= 10000
                                                              for h in honest.values()),
                  "liar_banned_within_16_at_99pct": all(v["banned_within_16_lying_groups"] >= 0.99 for v in liars.values()),
                  # lying in every group, every checked group is a lie
                  "liar_banned_within_8_checked": all((v["checked_groups_max"] or 99) <= WITHIN_CHECKED
                                                      for v in liars.values() if v["lie_every"] == 1),
                  "unchecked_liar_cosine_over_0_9": steer["kl clamp 2 (default)"]["cosine_with_honest_step"] > 0.9},
        "seconds": time.perf_counter() - started,
        "load_average_at_start": load_before, "load_average_at_end": os.getloadavg()[0],
        "machine_busy": os.getloadavg()[0] > 1.0,
    }
    md = [f"# Ban rate (issue 45)\n\nCheck rate {fraction}, tolerance {tolerance}, ban after {ban_after} groups over it among "
          f"the last {window} checked. Load average {load_before:.1f} -> {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores (busy: {figures['machine_busy']}); timing-free figures.\n\n## Honest samplers (every group checked)\n\n",
          markdown_table(["sampler", "completions", "gap max", "gap p99.9", "groups over", "false bans", "ban bound / window"],
                         [[k, h["completions_checked"], h["gap_max"], h["gap_p999"], h["groups_over_tolerance"], h["false_bans"],
                           h["window_ban_bound"]] for k, h in honest.items()]),
          f"\n## Liars (gap {LIE}), {trials} trials each, checks at {fraction}\n\nAnalytic, lying in every group: unbanned after 16 "
          f"with probability (1-f)^16 + 16 f (1-f)^15 = {analytic:.4f}.\n\n",
          markdown_table(["liar", "banned within 16 lying groups", "lying groups p50", "p99", "checked groups max", "never banned"],
                         [[k, v["banned_within_16_lying_groups"], v["lying_groups_p50"], v["lying_groups_p99"], v["checked_groups_max"],
                           v["never_banned"]] for k, v in liars.items()]),
          "\n## An unchecked lying group among 8 (default loss, real gradients)\n\n",
          markdown_table(["KL clamp", "cosine with honest step", "liar group grad norm", "largest honest group grad norm"],
                         [[k, v["cosine_with_honest_step"], v["liar_group_gradient_norm"], v["largest_honest_group_gradient_norm"]]
                          for k, v in steer.items()]),
          f"\nGoals: {figures['goals']}\n"]
    write_result("ban_rate", figures, "".join(md))
    return figures


if __name__ == "__main__":
    run()
