"""GEPO's weak spot (GitHub issue #19, item 4): at maximum staleness 8 GEPO ends below GRPO and its
learner drifts about 3x further from its samplers. This benchmark runs the staleness study's
harness (benchmarks/staleness.py, the in-process trainer) on GEPO variants with per-step
diagnostics switched on (swarm/losses/step_diagnostics.py), to find out why.

    python -m benchmarks.gepo_weak_spot            # the whole plan below (resumable)
    python -m benchmarks.gepo_weak_spot --quick    # gepo and grpo at staleness 8, one seed, 20 steps
    python -m benchmarks.gepo_weak_spot --report-only

Each finished run is appended to gepo_weak_spot_runs.jsonl in --out (first line: the settings), so
an interrupted plan resumes where it stopped (runs already there are not run again; other settings
are refused). The report, gepo_weak_spot.{md,json}, puts beside the variants the study's own GEPO
and GRPO runs (same harness and settings, so the same numbers: benchmarks/results/staleness.json
and exploration/gepo_grpo_staleness8_6seeds_shared_prompts), which carry pass@1 and KL but not the
new diagnostics.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS, markdown_table, write_result

# variant -> (LossConfig overrides of the paper's GEPO, TrainerConfig overrides). Rollouts per step stay 64.
VARIANTS: dict[str, tuple[dict, dict]] = {
    "gepo": ({}, {}),
    "grpo": ({"name": "grpo"}, {}),
    "gepo_eps0.1": ({"epsilon": 0.1, "epsilon_high": 0.1}, {}),
    "gepo_eps0.3": ({"epsilon": 0.3, "epsilon_high": 0.3}, {}),
    "gepo_noclip": ({"epsilon": 1e6, "epsilon_high": 1e6}, {}),
    "gepo_beta0": ({"beta": 0.0}, {}),
    "gepo_beta0.05": ({"beta": 0.05}, {}),
    "gepo_sum": ({"seq_logprob_mode": "sum"}, {}),
    "gepo_g4": ({}, {"num_generations": 4, "groups_per_step": 16}),
    "gepo_g16": ({}, {"num_generations": 16, "groups_per_step": 4}),
    "gepo_batch": ({"gepo_expectation": "batch"}, {}),
    # the sequence's own ratio p / q, clipped at GEPO's 0.2: GEPO without its w0 = q / E_q[q]
    "gspo_eps0.2": ({"name": "gspo", "epsilon": 0.2, "epsilon_high": 0.2}, {}),
    # GEPO's weight, but the clip on p / q (LossConfig.gepo_clip)
    "gepo_rhoclip": ({"gepo_clip": "ratio"}, {}),
    # GEPO's clip, and GRPO's token-level one on top (LossConfig.gepo_clip)
    "gepo_tokenclip": ({"gepo_clip": "weight+token"}, {}),
    # ... on negative-advantage tokens only
    "gepo_tokenclip_neg": ({"gepo_clip": "weight+token-neg"}, {}),
}

# What was run: (variant, staleness, seeds). Screening at staleness 8 on seed 0 (the seed where GEPO
# drifts most), then three seeds at 8 and 64 for the candidate fixes, six at 8 for the one that held.
PLAN: list[tuple[str, int, tuple[int, ...]]] = [
    ("gepo", 8, (0,)),
    ("grpo", 8, (0,)),
    ("gepo", 0, (0,)),
    ("gepo_eps0.1", 8, (0, 1, 2)),
    ("gepo_eps0.3", 8, (0,)),
    ("gepo_noclip", 8, (0,)),
    ("gepo_beta0", 8, (0,)),
    ("gepo_beta0.05", 8, (0,)),
    ("gepo_sum", 8, (0,)),
    ("gepo_g4", 8, (0,)),
    ("gepo_g16", 8, (0,)),
    ("gepo_batch", 8, (0,)),
    ("gspo_eps0.2", 8, (0,)),
    ("gepo_rhoclip", 8, (0,)),
    ("gepo_tokenclip", 8, (0, 1, 2)),
    ("gepo_tokenclip_neg", 8, (0, 1, 2, 3, 4, 5)),
    ("gepo_tokenclip", 0, (0,)),
    ("gepo_eps0.1", 64, (0, 1, 2)),
    ("gepo_tokenclip", 64, (0, 1, 2)),
    ("gepo_tokenclip_neg", 64, (0, 1, 2)),
]
QUICK_PLAN = [("gepo", 8, (0,)), ("grpo", 8, (0,))]

# The study's own runs of gepo and grpo, with these very settings.
BASELINES = [RESULTS / "exploration" / "gepo_grpo_staleness8_6seeds_shared_prompts" / "staleness.json",
             RESULTS / "staleness.json"]

SETTINGS = {"steps": 60, "prompts_per_step": 8, "group_size": 8, "lr": 2e-4, "eval_every": 10, "eval_problems": 200,
            "advantage_every": 10, "delay_shape": "uniform"}
QUICK_SETTINGS = {**SETTINGS, "steps": 20, "eval_problems": 100}

# per-step keys kept in the runs file
KEEP = ("step", "reward_mean", "staleness_mean", "kl_learner_sampler", "kl_sampler_learner", "is_weight_mean",
        "is_weight_var", "clip_frac", "loss", "policy_loss", "kl_penalty", "grad_norm",
        "adv_pos_frac", "adv_neg_frac", "clip_frac_pos", "clip_frac_neg", "coef_pos_share", "coef_net",
        "gepo_w0_mean", "gepo_w0_sd", "gepo_w0_adv", "gepo_w0_out", "seq_log_ratio_abs", "trust_escape_frac",
        "clip_by_bias_frac", "token_escape_frac", "token_escape_pos", "token_escape_neg", "grad_norm_pos",
        "grad_norm_neg", "grad_norm_kl", "grad_cos_pos_neg", "grad_cos_prev",
        "update_norm", "update_cos_prev", "step_kl", "step_kl_k3", "step_logprob_change", "step_logprob_change_pos",
        "step_logprob_change_neg", "learner_logprob_mean", "kl_by_staleness", "adv_err_gepo", "adv_err_seq",
        "adv_err_token")


def _round(v):
    if isinstance(v, float):
        return v if not math.isfinite(v) or v == 0 else float(f"{v:.5g}")
    if isinstance(v, dict):
        return {k: _round(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_round(x) for x in v]
    return v


def run_one(variant: str, staleness: int, seed: int, settings: dict) -> dict:
    import torch

    from benchmarks.staleness import delay_spec
    from peers.trainer import run_trainer
    from swarm.config import TrainerConfig
    from swarm.training import LearnerCore

    LearnerCore.step_diagnostics = True  # the whole process: gradient and movement diagnostics
    torch.set_num_threads(1)
    loss, trainer = VARIANTS[variant]
    config = TrainerConfig(
        loss={"name": "gepo", "gepo_clip": "weight", **loss}, steps=settings["steps"],
        groups_per_step=trainer.get("groups_per_step", settings["prompts_per_step"]),
        num_generations=trainer.get("num_generations", settings["group_size"]), learning_rate=settings["lr"],
        max_staleness=staleness, delay=delay_spec(settings["delay_shape"], staleness), eval_every=settings["eval_every"],
        eval_problems=settings["eval_problems"], eval_samples=1, seed=seed,
        advantage_diagnostic_every=settings["advantage_every"],
    )
    started = time.time()
    result = run_trainer(config)
    history = [{k: _round(h[k]) for k in KEEP if k in h} for h in result["history"]]
    accs = [e["pass_at_1"] for e in result["evals"]]
    return {"variant": variant, "staleness": staleness, "seed": seed, "loss_config": loss, "trainer_config": trainer,
            "evals": result["evals"], "best": max(accs[1:] or accs), "last": accs[-1], "initial": accs[0],
            "history": history, "seconds": time.time() - started}


# ----------------------------------------------------------------------------------------------
# Report


def _mean(values):
    values = [v for v in values if v is not None and isinstance(v, (int, float)) and math.isfinite(v)]
    return statistics.mean(values) if values else float("nan")


def run_summary(run: dict) -> dict:
    """One run's figures: pass@1, drift and the diagnostics, each a mean over its steps unless named."""
    h = run["history"]
    last10 = h[-10:]
    out = {"best": run["best"], "last": run["last"], "kl_last10": _mean([x.get("kl_learner_sampler") for x in last10]),
           "kl_mean": _mean([x.get("kl_learner_sampler") for x in h])}
    if "clip_frac_pos" in h[0]:
        pos = sum(x["adv_pos_frac"] for x in h)
        neg = sum(x["adv_neg_frac"] for x in h)
        out["clip_pos"] = sum(x["clip_frac_pos"] for x in h) / pos if pos else float("nan")
        out["clip_neg"] = sum(x["clip_frac_neg"] for x in h) / neg if neg else float("nan")
    for key in ("clip_frac", "coef_pos_share", "coef_net", "gepo_w0_mean", "gepo_w0_sd", "gepo_w0_adv", "gepo_w0_out",
                "seq_log_ratio_abs", "trust_escape_frac", "clip_by_bias_frac", "token_escape_frac", "token_escape_pos",
                "token_escape_neg", "grad_norm", "grad_norm_pos",
                "grad_norm_neg", "grad_norm_kl", "grad_cos_pos_neg", "grad_cos_prev", "update_norm", "update_cos_prev",
                "step_kl", "step_kl_k3", "step_logprob_change", "step_logprob_change_pos", "step_logprob_change_neg",
                "kl_sampler_learner",
                "learner_logprob_mean", "reward_mean", "is_weight_var"):
        if any(key in x for x in h):
            out[key] = _mean([x.get(key) for x in h])
    if any("kl_by_staleness" in x for x in h):
        sums: dict[int, list[float]] = {}
        for x in h:
            for s, (kl, tokens) in x.get("kl_by_staleness", {}).items():
                if math.isfinite(kl):
                    acc = sums.setdefault(int(s), [0.0, 0.0])
                    acc[0] += kl * tokens
                    acc[1] += tokens
        curve = {s: v[0] / v[1] for s, v in sorted(sums.items()) if v[1]}
        out["kl_by_staleness"] = curve
        # KL per step of staleness: least squares through the origin over the staleness levels seen
        num = sum(s * kl for s, kl in curve.items())
        den = sum(s * s for s in curve)
        out["kl_per_step_of_staleness"] = num / den if den else float("nan")
    return out


def load_baselines(paths: list[Path], settings: dict) -> list[dict]:
    """The study's gepo and grpo runs made with `settings`, as runs of variants 'gepo' and 'grpo'."""
    found: dict[tuple, dict] = {}
    for path in paths:
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        s = data.get("settings", {})
        if any(s.get(k) != settings[k] for k in ("steps", "prompts_per_step", "group_size", "lr", "eval_every",
                                                   "eval_problems", "delay_shape")):
            continue
        for r in data["runs"]:
            if r["loss"] in ("gepo", "grpo"):
                found.setdefault((r["loss"], r["staleness"], r["seed"]), {**r, "variant": r["loss"], "source": path.name})
    return list(found.values())


def mean_sd(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return float("nan"), float("nan")
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def fmt(pair, scale=1.0, digits=1):
    m, s = pair
    if not math.isfinite(m):
        return "-"
    return f"{scale * m:.{digits}f} ± {scale * s:.{digits}f}"


def report(runs: list[dict], baselines: list[dict], settings: dict, minutes: float, out: Path, name: str,
           notes: str = "") -> str:
    summaries = [(r, run_summary(r)) for r in runs]
    keys = sorted({(r["variant"], r["staleness"]) for r in runs}, key=lambda k: (k[1], list(VARIANTS).index(k[0])))
    drift_header = ["variant", "staleness", "seeds", "best pass@1", "last pass@1", "KL last 10", "KL all steps",
                    "KL(q‖p) all steps", "KL per step of staleness", "step KL(old‖new)"]
    why_header = ["variant", "staleness", "clip A>0", "clip A<0", "clipped by w0 alone", "token escape A>0 / A<0",
                  "coef net", "‖grad‖ A>0 / A<0", "Δ log p per step A>0 / A<0", "w0 sd", "mean w0·A"]
    drift_rows, why_rows, table = [], [], {}
    for variant, k in keys:
        sel = [s for r, s in summaries if r["variant"] == variant and r["staleness"] == k]
        seeds = sorted(r["seed"] for r in runs if r["variant"] == variant and r["staleness"] == k)

        def col(key, scale=1.0, digits=2):
            return fmt(mean_sd([s.get(key, float("nan")) for s in sel]), scale, digits)

        def pair(a, b, scale=1.0, digits=2):
            x, y = mean_sd([s.get(a, float("nan")) for s in sel])[0], mean_sd([s.get(b, float("nan")) for s in sel])[0]
            return f"{scale * x:.{digits}f} / {scale * y:.{digits}f}" if math.isfinite(x) else "-"

        drift_rows.append([variant, k, len(sel), col("best", 100, 1), col("last", 100, 1), col("kl_last10", 1e3, 1),
                           col("kl_mean", 1e3, 1), col("kl_sampler_learner", 1e3, 1),
                           col("kl_per_step_of_staleness", 1e3, 2), col("step_kl_k3", 1e3, 2)])
        why_rows.append([variant, k, col("clip_pos", 1, 3), col("clip_neg", 1, 3), col("clip_by_bias_frac", 1, 3),
                         pair("token_escape_pos", "token_escape_neg", 1, 3), col("coef_net", 1, 3),
                         pair("grad_norm_pos", "grad_norm_neg"),
                         pair("step_logprob_change_pos", "step_logprob_change_neg", 1e3, 1), col("gepo_w0_sd", 1, 3),
                         col("gepo_w0_adv", 1, 3)])
        table[f"{variant}@{k}"] = {
            "seeds": seeds,
            **{key: mean_sd([s.get(key, float("nan")) for s in sel]) for key in sel[0] if key != "kl_by_staleness"},
            "kl_by_staleness": {str(st): _mean([s["kl_by_staleness"].get(st) for s in sel if "kl_by_staleness" in s])
                                for st in sorted({st for s in sel for st in s.get("kl_by_staleness", {})})},
        }
    # the study's runs: pass@1 and drift on every seed it has
    base_rows, base_table = [], {}
    for variant in ("gepo", "grpo"):
        for k in sorted({b["staleness"] for b in baselines}):
            sel = [b for b in baselines if b["variant"] == variant and b["staleness"] == k]
            if not sel:
                continue
            figures = {"best": mean_sd([b["best"] for b in sel]), "last": mean_sd([b["last"] for b in sel]),
                       "kl_last10": mean_sd([_mean([x["kl_learner_sampler"] for x in b["history"][-10:]]) for b in sel]),
                       "kl_mean": mean_sd([_mean([x["kl_learner_sampler"] for x in b["history"]]) for b in sel]),
                       "kl_sampler_learner": mean_sd([_mean([x["kl_sampler_learner"] for x in b["history"]]) for b in sel])}
            base_rows.append([variant, k, len(sel), fmt(figures["best"], 100), fmt(figures["last"], 100),
                              fmt(figures["kl_last10"], 1e3), fmt(figures["kl_mean"], 1e3),
                              fmt(figures["kl_sampler_learner"], 1e3)])
            base_table[f"{variant}@{k}"] = {"seeds": sorted(b["seed"] for b in sel), **figures}
    # per-seed comparison with the study's own run of the same variant, seed and level where there is one
    paired = []
    for r, s in summaries:
        match = [b for b in baselines if b["variant"] == r["variant"] and b["staleness"] == r["staleness"]
                 and b["seed"] == r["seed"]]
        if match:
            same = [e["pass_at_1"] for e in match[0]["evals"]] == [e["pass_at_1"] for e in r["evals"]]
            paired.append(f"{r['variant']}@{r['staleness']} seed {r['seed']}: {'identical to' if same else 'DIFFERS from'} "
                          f"the study's run ({match[0]['source']})")
    # each variant against the study's gepo and grpo on the same seeds (last pass@1)
    same_seeds = []
    for variant, k in keys:
        own = {r["seed"]: r["last"] for r in runs if r["variant"] == variant and r["staleness"] == k}
        ref = {loss: {b["seed"]: b["last"] for b in baselines if b["variant"] == loss and b["staleness"] == k}
               for loss in ("gepo", "grpo")}
        seeds = sorted(seed for seed in own if seed in ref["gepo"] and seed in ref["grpo"])
        if len(seeds) < 2 or variant in ("gepo", "grpo"):
            continue
        mean = {name: 100 * statistics.mean(values[seed] for seed in seeds)
                for name, values in (("own", own), ("gepo", ref["gepo"]), ("grpo", ref["grpo"]))}
        same_seeds.append([variant, k, ",".join(map(str, seeds)), f"{mean['own']:.1f}", f"{mean['gepo']:.1f}",
                           f"{mean['grpo']:.1f}", f"{mean['own'] - mean['gepo']:+.1f}", f"{mean['own'] - mean['grpo']:+.1f}",
                           f"{sum(own[x] >= ref['gepo'][x] for x in seeds)}/{len(seeds)}",
                           f"{sum(own[x] >= ref['grpo'][x] for x in seeds)}/{len(seeds)}"])
    curves = []
    for variant, k in keys:
        curve = table[f"{variant}@{k}"]["kl_by_staleness"]
        if curve and k > 0:
            curves.append([variant, k] + [f"{1e3 * curve[str(st)]:.1f}" if str(st) in curve else "-" for st in range(9)])
    md = ["# GEPO's weak spot at staleness 8 (issue #19, item 4)\n",
          f"Settings: {json.dumps(settings)}; {len(runs)} runs with diagnostics, {minutes:.0f} min of run time "
          "(single-thread runs, sharing two cores with other work). `python -m benchmarks.gepo_weak_spot`.\n",
          "## Outcome and drift\n",
          "Held-out pass@1 in %, mean ± sd over seeds. KL = KL(learner ‖ sampler) per token (x1e3) on the step's "
          "rollouts, E_q[r log r] as the study reports it: the mean of the last 10 steps (the issue's figure; a few "
          "steps' spikes dominate it) and of all 60 steps; KL(q‖p) all steps is the k3 estimate of the reverse "
          "direction (never below 0). KL per step of staleness: least-squares slope of KL against each group's own "
          "staleness, over all steps (x1e3). step KL(old‖new): how far one optimizer step moved the policy on the "
          "step's own tokens (k3, x1e3).\n",
          markdown_table(drift_header, drift_rows), "",
          "## What the update does, by sign of advantage\n",
          "Means over steps (and seeds). clip A>0 / A<0: share of positive- / negative-advantage sequences (tokens "
          "for grpo) whose clipped branch was taken. clipped by w0 alone: share of sequences clipped although their "
          "own ratio p/q is inside the clip range. token escape: share of tokens whose own ratio p_t/q_t is past the "
          "clip range in the direction PPO stops while their sequence keeps its gradient (a token-level clip drops "
          "them; grpo has none by construction). coef net: sum of the update's coefficients on the log-probs over "
          "the sum of their magnitudes (> 0: the step raises the batch's own completions on balance). ‖grad‖: norm "
          "of the gradient of the positive- / negative-advantage part of the loss. Δ log p per step: mean change of "
          "the step's own tokens' log-probs by the step (x1e3). w0 = q / E_q[q], GEPO's weight if the learner were "
          "the sampler: its sd, and mean w0·A (0 for a weight of 1).\n",
          markdown_table(why_header, why_rows), "",
          "## The study's own runs (pass@1 and KL only)\n",
          markdown_table(["loss", "staleness", "seeds", "best", "last", "KL last 10", "KL all steps", "KL(q‖p) all steps"],
                         base_rows), ""]
    if same_seeds:
        md += ["## Against the study's gepo and grpo on the same seeds (last pass@1, %)\n",
               markdown_table(["variant", "staleness", "seeds", "variant", "gepo", "grpo", "- gepo", "- grpo",
                               ">= gepo", ">= grpo"], same_seeds), ""]
    if curves:
        md += ["## KL(learner || sampler) by each group's own staleness (x1e3, all steps)\n",
               markdown_table(["variant", "max staleness"] + [str(st) for st in range(9)], curves), ""]
    if paired:
        md += ["## Reproduction check\n", *[f"- {p}" for p in paired], ""]
    if notes:
        md += [notes]
    text = "\n".join(md) + "\n"
    write_result(name, {"settings": settings, "minutes": minutes, "table": table, "study": base_table,
                        "runs": [{k: v for k, v in r.items() if k != "history"} | {"summary": s} for r, s in summaries]},
                 text, out)
    return text


# ----------------------------------------------------------------------------------------------


def read_runs(path: Path) -> tuple[dict | None, list[dict]]:
    settings, runs = None, []
    if not path.is_file():
        return settings, runs
    for line in path.read_text().splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:  # a run cut short while being written: run again
            continue
        if "settings" in item:
            settings = item["settings"]
        elif "variant" in item:
            runs.append(item)
    return settings, runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gepo_weak_spot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="gepo and grpo at staleness 8, seed 0, 20 steps")
    parser.add_argument("--only", default=None,
                        help="run only these plan entries: comma-separated variant@staleness (e.g. gepo_sum@8)")
    parser.add_argument("--seeds", default=None,
                        help="seeds for the --only entries, comma-separated (default: the plan's, or 0)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from the runs file")
    parser.add_argument("--notes", type=Path, default=None, help="a markdown file appended to the report")
    args = parser.parse_args(argv)
    settings = QUICK_SETTINGS if args.quick else SETTINGS
    name = "gepo_weak_spot_quick" if args.quick else "gepo_weak_spot"
    runs_path = args.out / f"{name}_runs.jsonl"
    earlier_settings, earlier = read_runs(runs_path)
    if earlier_settings is not None and earlier_settings != settings:
        parser.error(f"{runs_path} holds runs made with other settings ({earlier_settings}); delete it to start over")
    plan = QUICK_PLAN if args.quick else PLAN
    if args.only:
        wanted = {tuple(item.split("@")) for item in args.only.split(",")}
        for variant, level in wanted:
            if variant not in VARIANTS:
                parser.error(f"unknown variant {variant!r}; choose from {sorted(VARIANTS)}")
        planned = {(v, k): seeds for v, k, seeds in PLAN}
        plan = [(v, int(k), tuple(int(x) for x in args.seeds.split(",")) if args.seeds else planned.get((v, int(k)), (0,)))
                for v, k in sorted(wanted)]
    jobs = [(v, k, seed) for v, k, seeds in plan for seed in seeds]
    done = {(r["variant"], r["staleness"], r["seed"]) for r in earlier}
    todo = [job for job in jobs if job not in done]
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        if earlier_settings is None:
            runs_path.write_text(json.dumps({"settings": settings}) + "\n")
        print(f"{len(jobs) - len(todo)} of {len(jobs)} runs already done; {len(todo)} to run", flush=True)
        for i, (variant, level, seed) in enumerate(todo, 1):
            run = run_one(variant, level, seed, settings)
            with runs_path.open("a") as f:
                f.write(json.dumps(run) + "\n")
            s = run_summary(run)
            print(f"[{i}/{len(todo)}] {variant} @{level} seed {seed}: best {run['best']:.3f} last {run['last']:.3f} "
                  f"KL10 {s['kl_last10']:.4f} clip+ {s.get('clip_pos', float('nan')):.3f} "
                  f"clip- {s.get('clip_neg', float('nan')):.3f} ({run['seconds']:.0f}s)", flush=True)
    _, runs = read_runs(runs_path)
    if not runs:
        parser.error(f"no runs in {runs_path}")
    minutes = sum(r["seconds"] for r in runs) / 60
    notes = args.notes.read_text() if args.notes else ""
    print(report(runs, load_baselines(BASELINES, settings), settings, minutes, args.out, name, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
