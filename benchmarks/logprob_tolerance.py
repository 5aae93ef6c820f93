"""Calibration of the learner's check of the behaviour log-probs (q) samplers report.

The statistic: for each completion, the mean over its tokens of |q_claimed - q_recomputed| (its
"gap"; 0 for an empty completion); a group is refused when its largest gap exceeds a tolerance t.
A liar that stays within t moves each sequence's mean log-ratio by at most t, so its importance
weights move by a factor of at most e^t.

Measured on the embedded default policy and task, temperature and max_completion_length as the
run's defaults give them (GenerationSettings):
1. honest samplers: the transformers backend in float32, bfloat16 and float16 (CPU; reduced
   precision stands in for a GPU sampler: vLLM is not measured), also with top-p / top-k
   filtering; the learner recomputes in float32 with `completion_logprobs`, once with the groups
   shuffled into micro-batches of 16 groups (padding differs from the sampler's) and once with each
   group alone (what a per-group check does);
2. liars: q + c and q * 0.5 on top of honest claims, and which tolerances refuse them;
3. cost: one no-grad forward per group at a held version (load_state_dict into a second model copy,
   then the forward) against one LearnerCore step on 32 groups.
"""

from __future__ import annotations

import copy
import math
import random
import statistics
import time

import torch

from benchmarks.common import markdown_table, write_result
from swarm.config import GenerationSettings, LearnerConfig, TaskSettings, default_of
from swarm.generation import SamplingParams, make_backend
from swarm.logprobs import MIN_LOGPROB, completion_logprobs
from swarm.model.loading import load_policy, resolve_model_dir
from swarm.rollouts import RolloutGroup, collate
from swarm.tasks import load_problems
from swarm.training import LearnerCore

# (label, sampler dtype, top_k, top_p); the first three (default sampling) set the tolerance
HONEST = [
    ("fp32", "float32", 0, 1.0),
    ("bf16", "bfloat16", 0, 1.0),
    ("fp16", "float16", 0, 1.0),
    ("fp32 top_p=0.9", "float32", 0, 0.9),
    ("fp32 top_k=20", "float32", 20, 1.0),
    ("fp32 top_k=20 top_p=0.9", "float32", 20, 0.9),
    ("bf16 top_p=0.9", "bfloat16", 0, 0.9),
    ("fp16 top_p=0.9", "float16", 0, 0.9),
]
TOLERANCE_SETS = ("fp32", "bf16", "fp16")
LIAR_SHIFTS = (0.05, 0.1, 0.5, 1.0)
LIAR_BASES = ("fp32", "bf16")
CANDIDATES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # round numbers, 1-2-5 series
SHOWN_TOLERANCES = (0.01, 0.02, 0.05, 0.1, 0.2)
MARGIN = 5.0  # the tolerance must be at least this many times the largest honest gap


def sequence_gap(claimed: list[float], recomputed: list[float]) -> float:
    """The learner's statistic (swarm.verification.completion_gaps) for one completion: mean over
    its tokens of |claimed - recomputed|, leaving out tokens the learner's own filter removes; 0 for
    an empty completion."""
    from swarm.verification import completion_gaps

    if not claimed:
        return 0.0
    return float(completion_gaps(torch.tensor([claimed]), torch.tensor([recomputed]), torch.ones(1, len(claimed)))[0])


def recompute(model, groups: list[RolloutGroup], pad_id: int, *, groups_per_batch: int, shuffle_seed: int | None) -> list[list[list[float]]]:
    """Per group, per completion, the learner's per-token log-probs (float32 model, no grad), with
    groups collated `groups_per_batch` at a time in a shuffled (or the given) order."""
    order = list(range(len(groups)))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    out: list[list[list[float]] | None] = [None] * len(groups)
    g0 = groups[0]
    with torch.no_grad():
        for start in range(0, len(order), groups_per_batch):
            idx = order[start : start + groups_per_batch]
            batch = collate([groups[i] for i in idx], pad_id)
            lp = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                                     temperature=g0.temperature, top_k=g0.top_k, top_p=g0.top_p).tolist()
            row = 0
            for i in idx:
                out[i] = []
                for c in groups[i].completion_ids:
                    out[i].append(lp[row][: len(c)])
                    row += 1
    return out  # type: ignore[return-value]


def group_gaps(groups: list[RolloutGroup], recomputed, claimed_of=None) -> list[list[float]]:
    """Per group, per completion gap; `claimed_of(lps)` turns honest claims into a liar's."""
    claimed_of = claimed_of or (lambda lps: lps)
    return [[sequence_gap(claimed_of(lps), rec) for lps, rec in zip(g.sampler_logprobs, recs)]
            for g, recs in zip(groups, recomputed)]


def quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def refused_fraction(gaps: list[list[float]], tolerance: float) -> float:
    return sum(max(g, default=0.0) > tolerance for g in gaps) / len(gaps)


def reward(text: str, answer: str) -> float:
    return float(f"\\boxed{{{answer}}}" in text.replace(" ", ""))  # timing only: no math-verify needed


def run(num_prompts: int = 64, step_repeats: int = 5, model_dir: str | None = None) -> dict:
    started = time.perf_counter()
    task, gen_settings = TaskSettings(), GenerationSettings()
    source = resolve_model_dir(model_dir)
    learner_model, tokenizer = load_policy(source, dtype="float32")
    learner_model.eval()
    pad_id = tokenizer.pad_token_id
    problems = load_problems(task.task, task.task_options(), tokenizer=tokenizer)[:num_prompts]
    prompts = [p.prompt for p in problems]
    group_size = gen_settings.num_generations
    max_new = default_of(GenerationSettings, "max_completion_length")
    temperature = gen_settings.temperature

    # --- honest samplers ----------------------------------------------------------------------
    backends = {}
    honest, groups_by = {}, {}
    for label, dtype, top_k, top_p in HONEST:
        if dtype not in backends:
            backends[dtype] = make_backend("transformers", source, dtype=dtype)
        params = SamplingParams(num_completions=group_size, temperature=temperature, top_k=top_k, top_p=top_p,
                                max_new_tokens=max_new, seed=1)
        t0 = time.perf_counter()
        gens = backends[dtype].generate(prompts, params)
        gen_s = time.perf_counter() - t0
        groups = [RolloutGroup(p.problem_id, g.prompt_ids, g.completion_ids, g.completion_logprobs,
                               [reward(t, p.answer) for t in g.texts], 0, "bench", answer=p.answer,
                               completion_texts=g.texts, temperature=temperature, top_k=top_k, top_p=top_p)
                  for p, g in zip(problems, gens)]
        mixed = recompute(learner_model, groups, pad_id, groups_per_batch=16, shuffle_seed=0)
        alone = recompute(learner_model, groups, pad_id, groups_per_batch=1, shuffle_seed=None)
        gaps_mixed, gaps_alone = group_gaps(groups, mixed), group_gaps(groups, alone)
        flat = [x for g in gaps_mixed for x in g]
        flat_alone = [x for g in gaps_alone for x in g]
        group_max = [max(g) for g in gaps_mixed]
        flips = sum(r <= MIN_LOGPROB / 2 for recs in mixed for rec in recs for r in rec)
        honest[label] = {
            "sampler_dtype": dtype, "top_k": top_k, "top_p": top_p,
            "completions": len(flat), "tokens": sum(len(c) for g in groups for c in g.completion_ids),
            "completion_lengths": [min(len(c) for g in groups for c in g.completion_ids),
                                   max(len(c) for g in groups for c in g.completion_ids)],
            "generate_s": gen_s,
            "gap_max": max(flat), "gap_p99": quantile(flat, 0.99), "gap_p50": quantile(flat, 0.5),
            "gap_max_group_alone": max(flat_alone),
            "group_max_gap_p50": quantile(group_max, 0.5), "group_max_gap_max": max(group_max),
            "filtered_token_flips": int(flips),  # sampled tokens the learner's top-k/top-p filter removes
            "groups_refused": {str(t): refused_fraction(gaps_mixed, t) for t in CANDIDATES},
        }
        groups_by[label] = (groups, mixed)
        print(f"  honest {label}: {len(flat)} completions, gap max {max(flat):.3g} p99 {quantile(flat, .99):.3g} "
              f"p50 {quantile(flat, .5):.3g}, flips {flips}", flush=True)
    del backends

    # largest honest gap at the run's default sampling, in either layout
    largest_from = max(TOLERANCE_SETS, key=lambda k: max(honest[k]["gap_max"], honest[k]["gap_max_group_alone"]))
    largest = max(honest[largest_from]["gap_max"], honest[largest_from]["gap_max_group_alone"])
    largest_fp32_fp16 = max(max(honest[k]["gap_max"], honest[k]["gap_max_group_alone"]) for k in ("fp32", "fp16"))

    # --- liars --------------------------------------------------------------------------------
    liars = {}
    for base in LIAR_BASES:
        groups, mixed = groups_by[base]
        variants = [(f"q + {c}", c, (lambda c: lambda lps: [x + c for x in lps])(c)) for c in LIAR_SHIFTS]
        variants.append(("q * 0.5", None, lambda lps: [0.5 * x for x in lps]))
        for name, c, fn in variants:
            gaps = group_gaps(groups, mixed, fn)
            flat = [x for g in gaps for x in g]
            if c is not None:
                factors = [math.exp(c)]
            else:  # claimed log q halved: the sequence's mean log-ratio moves by mean(0.5 |log q|)
                factors = [math.exp(sum(-0.5 * x for x in lps) / len(lps)) for g in groups for lps in g.sampler_logprobs if lps]
            liars[f"{name} on {base}"] = {
                "liar": name, "base_sampler": base, "shift": c,
                "gap_min": min(flat), "gap_p50": quantile(flat, 0.5), "gap_max": max(flat),
                "weight_factor_p50": quantile(factors, 0.5), "weight_factor_max": max(factors),
                "groups_refused": {str(t): refused_fraction(gaps, t) for t in CANDIDATES},
            }

    # --- recommended tolerance ----------------------------------------------------------------
    def catches_all(t: float, shift: float) -> bool:
        return all(liars[f"q + {shift} on {b}"]["groups_refused"][str(t)] == 1.0 for b in LIAR_BASES)

    with_margin = [t for t in CANDIDATES if t >= MARGIN * largest]
    feasible = [t for t in with_margin if catches_all(t, 0.1)]
    catching = [t for t in CANDIDATES if catches_all(t, 0.1) and all(honest[k]["groups_refused"][str(t)] == 0.0 for k in TOLERANCE_SETS)]
    if feasible:
        recommended, rule_met = feasible[0], True
    else:  # the margin and the c=0.1 catch cannot both hold: keep the catch, take the widest such tolerance
        recommended, rule_met = (max(catching) if catching else None), False
    rec_fp32_fp16 = next((t for t in CANDIDATES if t >= MARGIN * largest_fp32_fp16 and catches_all(t, 0.1)), None)

    # --- cost ---------------------------------------------------------------------------------
    train_model, _ = load_policy(source, dtype="float32")
    core = LearnerCore(train_model, pad_id)
    step_groups = groups_by["fp32"][0][:32]
    held = [{k: v.detach().clone() for k, v in train_model.state_dict().items()}]
    verifier = copy.deepcopy(train_model).eval()
    model_bytes = sum(t.numel() * t.element_size() for t in list(verifier.parameters()) + list(verifier.buffers()))

    def verify(chunk: list[RolloutGroup], state) -> tuple[float, float]:
        """load_state_dict of a held version, then one no-grad forward over `chunk` and its gaps."""
        t0 = time.perf_counter()
        verifier.load_state_dict(state, strict=True)
        t1 = time.perf_counter()
        batch = collate(chunk, pad_id)
        g = chunk[0]
        with torch.no_grad():
            lp = completion_logprobs(verifier, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                     batch.completion_mask, temperature=g.temperature, top_k=g.top_k, top_p=g.top_p)
        mask = batch.completion_mask
        gap = ((lp - batch.sampler_logprobs).abs() * mask).sum(1) / mask.sum(1).clamp(min=1)
        gap.new_full((len(chunk),), float("-inf")).scatter_reduce(0, batch.group_ids, gap, "amax").tolist()
        return t1 - t0, time.perf_counter() - t1

    core.step(step_groups)  # warm-up (also the first optimizer state)
    held.append({k: v.detach().clone() for k, v in train_model.state_dict().items()})
    for g in step_groups[:4]:
        verify([g], held[0])
    verify(step_groups, held[0])
    step_s, verify_all_s, load_s, forward_s, batched_s = [], [], [], [], []
    for r in range(step_repeats):
        t0 = time.perf_counter()
        core.step(step_groups)
        step_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i, g in enumerate(step_groups):
            lo, fw = verify([g], held[(i + r) % 2])  # alternate held versions: every load copies weights
            load_s.append(lo)
            forward_s.append(fw)
        verify_all_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        verify(step_groups, held[r % 2])  # for comparison: all 32 groups at one held version, one forward
        batched_s.append(time.perf_counter() - t0)
    # Ratios use the best of the repeats (the machine's other load only ever adds time); medians are kept too.
    step_best, verify_best, batched_best = min(step_s), min(verify_all_s), min(batched_s)
    cost = {
        "groups_per_step": len(step_groups), "group_size": group_size,
        "learner_step_s_best": step_best, "learner_step_s_median": statistics.median(step_s),
        "verify_32_groups_s_best": verify_best, "verify_32_groups_s_median": statistics.median(verify_all_s),
        "verify_one_group_s": verify_best / len(step_groups),
        "load_state_dict_s_median": statistics.median(load_s),
        "forward_s_median": statistics.median(forward_s),
        "ratio_by_fraction": {str(f): f * verify_best / step_best for f in (1.0, 0.5, 0.25)},
        "verify_32_groups_one_forward_s_best": batched_best,
        "ratio_32_groups_one_forward": batched_best / step_best,
        "model_copy_bytes": model_bytes,
        "model_parameters": sum(p.numel() for p in verifier.parameters()),
        "repeats": step_repeats,
    }

    figures = {
        "model": model_dir or "embedded", "task": task.task, "task_options": task.task_options(), "prompts": len(prompts),
        "group_size": group_size, "temperature": temperature, "max_completion_length": max_new,
        "statistic": "per completion: mean over tokens of |q_claimed - q_recomputed|; group refused when its max > tolerance",
        "learner_layouts": {"mixed": "groups shuffled, collated 16 groups per micro-batch", "alone": "each group collated alone"},
        "vllm_measured": False,
        "honest": honest, "liars": liars, "cost": cost,
        "largest_honest_gap": largest, "largest_honest_gap_sampler": largest_from, "largest_honest_gap_fp32_fp16": largest_fp32_fp16,
        "margin": MARGIN, "candidates": list(CANDIDATES),
        "rule_met": rule_met, "recommended_tolerance": recommended,
        "default_tolerance": default_of(LearnerConfig, "verify_tolerance"),
        "recommended_tolerance_fp32_fp16_samplers": rec_fp32_fp16,
        "rule_tolerance_ignoring_liars": with_margin[0] if with_margin else None,
        "seconds": time.perf_counter() - started,
    }
    write_result("logprob_tolerance", figures, markdown(figures))
    return figures


def markdown(f: dict) -> str:
    h, liars, cost = f["honest"], f["liars"], f["cost"]
    rec = f["recommended_tolerance"]
    rec_key = str(rec) if rec is not None else None
    md = "# Tolerance for the sampler log-prob (q) check\n\n"
    md += ("Reproduce: `.venv/bin/python -m benchmarks logprob_tolerance` from the repo root.\n\n"
           "Statistic: per completion, the **gap** = mean over its tokens of |q_claimed - q_recomputed| (0 for an empty "
           "completion); a group is refused when its largest gap exceeds the tolerance t. A liar within t shifts a "
           "sequence's mean log-ratio by at most t, so its importance weights by a factor of at most e^t.\n\n"
           f"Setup: embedded policy ({cost['model_parameters']:,} parameters), task `{f['task']}` {f['task_options']}, "
           f"{f['prompts']} prompts x G={f['group_size']}, temperature {f['temperature']}, max_completion_length "
           f"{f['max_completion_length']}; transformers backend on CPU; learner recomputes in float32 with "
           "`completion_logprobs`, groups shuffled into micro-batches of 16 groups (so padding differs from the "
           "sampler's). \"alone max\": the same with each group collated alone. **vLLM was not measured (no GPU here)**: "
           "bf16/fp16 CPU samplers stand in for a reduced-precision GPU sampler.\n\n")
    md += "## Honest samplers\n\n"
    rows = []
    for label, r in h.items():
        refused = f"{100 * r['groups_refused'][rec_key]:.1f}%" if rec_key else "-"
        rows.append([label, r["completions"], r["gap_max"], r["gap_p99"], r["gap_p50"], r["gap_max_group_alone"],
                     r["group_max_gap_p50"], r["filtered_token_flips"], refused])
    md += markdown_table(["sampler", "completions", "gap max", "gap p99", "gap p50", "alone max",
                          "group-max gap p50", "filtered-token flips", f"groups refused at t={rec}"], rows)
    flips = {k: r["filtered_token_flips"] for k, r in h.items() if r["filtered_token_flips"]}
    if flips:
        md += ("\nFiltered-token flips: a token the reduced-precision sampler kept inside its top-p/top-k set falls "
               f"outside the float32 learner's, which recomputes it at the floor {MIN_LOGPROB:g}. Counted as is, that "
               "completion's gap would be hundreds and its honest group refused at any tolerance (3-5% of groups here); "
               "the learner's statistic leaves such tokens out (their p is ~0 whatever q is claimed), and the gaps above "
               "are with them left out (" + ", ".join(f"{k}: {v} token(s)" for k, v in flips.items()) + ").\n")
    md += "\n## Liars (every completion of the group lies)\n\n"
    rows = []
    for r in liars.values():
        factor = f"e^{r['shift']} = {r['weight_factor_p50']:.3g}" if r["shift"] is not None else \
            f"p50 {r['weight_factor_p50']:.3g}, max {r['weight_factor_max']:.3g}"
        rows.append([r["liar"], r["base_sampler"], r["gap_min"], r["gap_p50"], factor] +
                    ["%.0f%%" % (100 * r["groups_refused"][str(t)]) for t in SHOWN_TOLERANCES])
    md += markdown_table(["claimed log q", "on honest", "gap min", "gap p50", "IS weight factor"] +
                         [f"refused t={t}" for t in SHOWN_TOLERANCES], rows)
    md += ("\nq + c claims a larger q, so p/q shrinks by e^c; q - c gives the same gap and grows p/q by e^c. "
           "A liar with c equal to t is refused or admitted by float rounding: only c clearly above t is caught. "
           "q * 0.5 is caught or not depending on how confident the policy is (its gap is half the mean |log q|).\n")
    md += "\n## Cost of verifying (one no-grad forward per group at a held version)\n\n"
    md += markdown_table(
        ["what", "seconds"],
        [["learner step, 32 groups (LearnerCore defaults)", cost["learner_step_s_best"]],
         ["verify 32 groups, one group per forward", cost["verify_32_groups_s_best"]],
         ["  of which load_state_dict, per group", cost["load_state_dict_s_median"]],
         ["  of which forward + gap, per group", cost["forward_s_median"]],
         ["for comparison: 32 groups of one held version in one forward (1 load)", cost["verify_32_groups_one_forward_s_best"]]])
    md += (f"\nBest of {cost['repeats']} interleaved repeats (per-group parts: medians). Each group gets its own load_state_dict and forward, "
           "as when the groups come from different held versions.\n")
    md += "\n" + markdown_table(["groups verified", "verify / step time"],
                                [[f"{int(float(k) * cost['groups_per_step'])} of {cost['groups_per_step']} ({k})", v]
                                 for k, v in cost["ratio_by_fraction"].items()]
                                + [["32 of 32, one forward for all (same held version)", cost["ratio_32_groups_one_forward"]]])
    md += (f"\nExtra memory: one model copy, {cost['model_copy_bytes']:,} bytes ({cost['model_copy_bytes'] / 2**20:.1f} MiB) "
           "in float32 (the held versions' weights are not counted).\n")
    md += "\n## Recommended tolerance\n\n"
    largest = f["largest_honest_gap"]
    if f["rule_met"]:
        md += (f"**t = {rec}**: the smallest round number >= {f['margin']:g}x the largest honest gap at default sampling "
               f"({largest:.3g}, over fp32, bf16 and fp16, {h['fp32']['completions']} completions each, both layouts; from the {f['largest_honest_gap_sampler']} sampler) "
               "that refuses every c=0.1 liar group.\n")
    else:
        md += (f"The two conditions cannot both hold: {f['margin']:g}x the largest honest gap ({largest:.3g}, over fp32, bf16 "
               f"and fp16, {h['fp32']['completions']} completions each, both layouts; from the "
               f"{f['largest_honest_gap_sampler']} sampler) is "
               f"{f['margin'] * largest:.3g}, so the rule's round number would be t = {f['rule_tolerance_ignoring_liars']}, which lets "
               f"c=0.1 liars through (their gap is about 0.1).\n\n**Recommended: t = {rec}**, the largest round number that "
               f"still refuses every c=0.1 liar group and no honest group at default sampling; its margin over the "
               f"largest honest gap is {rec / largest:.1f}x, not {f['margin']:g}x" if rec is not None else
               "\nNo round number refuses every c=0.1 liar and admits every honest group.")
        if rec is not None:
            md += (f". Where samplers run fp32 or fp16, t = {f['recommended_tolerance_fp32_fp16_samplers']} meets the "
                   f"{f['margin']:g}x rule (largest gap {f['largest_honest_gap_fp32_fp16']:.3g}).\n")
    default = f["default_tolerance"]
    md += (f"\n## The default: t = {default:g} (`--verify-tolerance`)\n\n"
           f"{default / largest:.1f}x the largest honest gap measured here, so a bf16 sampler passes with room to spare; a liar "
           f"within it moves an importance weight by at most e^{default:g} = {math.exp(default):.3f}, inside PPO's clip range "
           "(epsilon 0.2). Tokens the learner's own top-k/top-p filter removes are left out of the gap (their p is ~0 "
           "whatever q is claimed), which is why the filtered-token flips above no longer refuse honest groups.\n")
    return md
