"""The staleness study (GEPO paper, Table 1 at small scale): every registered loss trained on
rollouts from past versions of its own policy, at several maximum staleness levels and seeds,
with held-out accuracy every few steps.

    python -m benchmarks.staleness --quick     # a few minutes: gepo, grpo, gspo; staleness 0 and 64; 1 seed; 40 steps
    python -m benchmarks.staleness             # the full study: 8 losses x {0, 8, 64} x 3 seeds; 60 steps

Staleness K means each virtual sampler's delay is drawn uniformly from 0..K steps (or, with
--delay-shape, always K or log-normal as in the paper), capped by the versions that exist; K = 0 is
online RL. Seeds, prompts, schedule and evaluation are the same for every loss, so differences come
from the loss alone. Writes benchmarks/results/staleness.json, staleness.md, staleness_curves.png and
staleness_diagnostics.png.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from benchmarks.common import RESULTS, markdown_table, write_result

ALL_LOSSES = ["gepo", "grpo", "gspo", "dr_grpo", "bnpo", "gmpo", "topr", "cispo"]


DELAY_SHAPES = ("uniform", "fixed", "lognormal")


def delay_spec(shape: str, staleness: int) -> str:
    """The delay distribution (swarm/staleness.py) of maximum staleness K in the given shape.

    lognormal keeps the paper's proportions: delays of 60..1920 s at 30 s per step are 2..64 steps,
    so K steps becomes a log-normal between K/32 and K steps (K * 30 / 32 .. K * 30 s at 30 s/step).
    """
    if staleness == 0:
        return "none"
    if shape == "lognormal":
        return f"lognormal:{staleness * 30 / 32:g},{staleness * 30},30"
    return f"{shape}:{staleness}"


def run_one(loss: str, staleness: int, seed: int, args) -> dict:
    from swarm.local_training import LocalRunConfig, run_local
    from swarm.losses import LossConfig

    config = LocalRunConfig(
        loss=LossConfig(name=loss), steps=args.steps, prompts_per_step=args.prompts_per_step, group_size=args.group_size,
        lr=args.lr, delay=delay_spec(getattr(args, "delay_shape", "uniform"), staleness), max_staleness=max(staleness, 0),
        eval_every=args.eval_every, eval_problems=args.eval_problems, eval_samples=1, seed=seed,
        advantage_diagnostic_every=args.advantage_every,
    )
    started = time.time()
    result = run_local(config)
    keep = ("step", "reward_mean", "staleness_mean", "staleness_max", "kl_learner_sampler", "kl_sampler_learner",
            "is_weight_var", "is_weight_mean", "clip_frac", "loss", "grad_norm", "adv_err_gepo", "adv_err_seq", "adv_err_token")
    history = [{k: h[k] for k in keep if k in h} for h in result["history"]]
    accs = [e["pass_at_1"] for e in result["evals"]]
    return {"loss": loss, "staleness": staleness, "seed": seed, "evals": result["evals"], "history": history,
            "best": max(accs[1:] or accs), "last": accs[-1], "initial": accs[0], "seconds": time.time() - started}


def summarise(runs: list[dict], losses: list[str], levels: list[int]) -> tuple[list[list], dict]:
    def mean_sd(values):
        return (statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0)

    rows, summary = [], {}
    for loss in losses:
        for k in levels:
            sel = [r for r in runs if r["loss"] == loss and r["staleness"] == k]
            if not sel:
                continue
            best, last = mean_sd([r["best"] for r in sel]), mean_sd([r["last"] for r in sel])
            gap = mean_sd([r["best"] - r["last"] for r in sel])
            summary[f"{loss}@{k}"] = {"best": best, "last": last, "gap": gap, "seeds": len(sel)}
            rows.append([loss, k, f"{100 * best[0]:.1f} ± {100 * best[1]:.1f}", f"{100 * last[0]:.1f} ± {100 * last[1]:.1f}",
                         f"{100 * gap[0]:.1f} ± {100 * gap[1]:.1f}", len(sel)])
    return rows, summary


def drops(summary: dict, losses: list[str], levels: list[int]) -> list[list]:
    lo, hi = min(levels), max(levels)
    out = []
    for loss in losses:
        if f"{loss}@{lo}" in summary and f"{loss}@{hi}" in summary:
            a, b = summary[f"{loss}@{lo}"]["last"][0], summary[f"{loss}@{hi}"]["last"][0]
            out.append([loss, f"{100 * a:.1f}", f"{100 * b:.1f}", f"{100 * (a - b):.1f}", f"{100 * (a - b) / a:.1f}%" if a else "-"])
    return out


def mean_curve(runs: list[dict], loss: str, level: int) -> list[tuple[int, float]]:
    """(step, pass@1 averaged over seeds) at every evaluation of one loss at one staleness level."""
    sel = [r for r in runs if r["loss"] == loss and r["staleness"] == level]
    if not sel:
        return []
    return [(e["step"], statistics.mean(r["evals"][j]["pass_at_1"] for r in sel)) for j, e in enumerate(sel[0]["evals"])]


def first_step_reaching(curve: list[tuple[int, float]], accuracy: float) -> float | None:
    """The step at which a learning curve first reaches `accuracy` (linear between evaluations);
    None when it never does."""
    for (s0, a0), (s1, a1) in zip(curve, curve[1:]):
        if a0 >= accuracy:
            return float(s0)
        if a1 >= accuracy:
            return s0 + (s1 - s0) * (accuracy - a0) / (a1 - a0)
    return float(curve[-1][0]) if curve and curve[-1][1] >= accuracy else None


def online_equivalent_steps(runs: list[dict], losses: list[str], levels: list[int]) -> list[list]:
    """How far behind online training each stale run ended, in steps of the same loss's online run.

    Stale data lag the learner: a learner whose groups are d steps old at the end can be expected to
    end roughly where online training was d steps earlier, even with a perfect importance weight.
    So a stale run's last accuracy is placed on its own loss's online curve (the step at which online
    training first reached it) and set beside that lag-only expectation, steps - d; a loss below it
    lost more than the data's age explains. A crude yardstick (online curves are noisy and flatten),
    but it separates "learned late" from "learned wrong".
    """
    rows = []
    for k in [k for k in levels if k > 0]:
        for loss in losses:
            online, stale = mean_curve(runs, loss, 0), mean_curve(runs, loss, k)
            if not online or not stale:
                continue
            steps = stale[-1][0]
            tail = [h["staleness_mean"] for r in runs if r["loss"] == loss and r["staleness"] == k
                    for h in r["history"] if h["step"] > steps - 10]
            lag = statistics.mean(tail) if tail else float("nan")
            reached = first_step_reaching(online, stale[-1][1])
            rows.append([loss, k, f"{100 * stale[-1][1]:.1f}", "not reached" if reached is None else round(reached),
                         round(steps - lag)])
    return rows


def correlations(runs: list[dict]) -> dict:
    import numpy as np

    steps = [h for r in runs for h in r["history"] if h["step"] > 1]
    stal = np.array([h["staleness_mean"] for h in steps])
    kl = np.array([h["kl_learner_sampler"] for h in steps])
    var = np.array([h["is_weight_var"] for h in steps])

    def corr(a, b):
        return float(np.corrcoef(a, b)[0, 1]) if a.std() > 0 and b.std() > 0 else float("nan")

    out = {"staleness_vs_kl": corr(stal, kl), "kl_vs_is_weight_var": corr(kl, var), "staleness_vs_is_weight_var": corr(stal, var)}
    diag = [h for h in steps if "adv_err_gepo" in h and all(np.isfinite(h[f"adv_err_{w}"]) for w in ADV_WEIGHTS)]
    if len(diag) > 2:
        d_stal = np.array([h["staleness_mean"] for h in diag])
        d_kl = np.array([h["kl_learner_sampler"] for h in diag])
        for w in ADV_WEIGHTS:
            err = np.array([h[f"adv_err_{w}"] for h in diag])
            out[f"staleness_vs_adv_err_{w}"] = corr(d_stal, err)
            out[f"kl_vs_adv_err_{w}"] = corr(d_kl, err)
            out[f"mean_adv_err_{w}"] = float(err.mean())
    return out


ADV_WEIGHTS = ("gepo", "seq", "token")


def advantage_error_by_staleness(runs: list[dict], levels: list[int]) -> list[list]:
    """Mean error of the estimated expected advantage per staleness level, for each weight."""
    rows = []
    for k in levels:
        hs = [h for r in runs if r["staleness"] == k for h in r["history"] if "adv_err_gepo" in h]
        vals = {w: [h[f"adv_err_{w}"] for h in hs if h[f"adv_err_{w}"] == h[f"adv_err_{w}"]] for w in ADV_WEIGHTS}
        if any(vals.values()):
            rows.append([k] + [statistics.mean(v) if v else float("nan") for v in vals.values()] + [len(hs)])
    return rows


def training_data_by_level(runs: list[dict], levels: list[int]) -> list[list]:
    rows = []
    for k in levels:
        hs = [h for r in runs if r["staleness"] == k for h in r["history"]]
        if hs:
            rows.append([k, statistics.mean(h["reward_mean"] for h in hs), statistics.mean(h["staleness_mean"] for h in hs)])
    return rows


def plot(runs: list[dict], losses: list[str], levels: list[int], out) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One accuracy scale for every staleness level, so that the drop shows.
    fig, axes = plt.subplots(1, len(levels), figsize=(5 * len(levels), 4), squeeze=False, sharey=True)
    for ax, k in zip(axes[0], levels):
        for i, loss in enumerate(losses):
            sel = [r for r in runs if r["loss"] == loss and r["staleness"] == k]
            if not sel:
                continue
            steps = [e["step"] for e in sel[0]["evals"]]
            mean = [statistics.mean(r["evals"][j]["pass_at_1"] for r in sel) for j in range(len(steps))]
            ax.plot(steps, mean, "o-", ms=3, color=f"C{i}", label=loss, lw=2.5 if loss == "gepo" else 1.2)
        ax.set_title(f"max staleness {k} steps")
        ax.set_xlabel("learner step")
        ax.set_ylabel("held-out pass@1")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "staleness_curves.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for i, loss in enumerate(losses):
        hs = [h for r in runs if r["loss"] == loss for h in r["history"] if h["step"] > 1]
        axes[0].scatter([h["staleness_mean"] for h in hs], [h["kl_learner_sampler"] for h in hs], s=5, color=f"C{i}", label=loss, alpha=0.5)
        axes[1].scatter([h["kl_learner_sampler"] for h in hs], [max(h["is_weight_var"], 1e-9) for h in hs], s=5, color=f"C{i}", label=loss, alpha=0.5)
    diag = [h for r in runs for h in r["history"] if "adv_err_gepo" in h and h["step"] > 1]
    for j, w in enumerate(ADV_WEIGHTS):
        axes[2].scatter([h["staleness_mean"] for h in diag], [h[f"adv_err_{w}"] for h in diag], s=6, color=f"C{j}", label=f"{w} weight", alpha=0.5)
    axes[2].set_xlabel("mean staleness of the step (steps)")
    axes[2].set_ylabel("|E_p[A] - E_q[w A]| (per group, mean)")
    if any(h[f"adv_err_{w}"] > 0 for h in diag for w in ADV_WEIGHTS):
        axes[2].set_yscale("log")
    else:
        axes[2].text(0.5, 0.5, "advantage diagnostic not measured\n(--advantage-every 0)", ha="center", transform=axes[2].transAxes)
    axes[0].set_xlabel("mean staleness of the step (steps)")
    axes[0].set_ylabel("KL(learner || sampler) per token")
    axes[1].set_xlabel("KL(learner || sampler) per token")
    axes[1].set_ylabel("importance-weight variance (loss's own level)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, markerscale=3)
    fig.tight_layout()
    fig.savefig(out / "staleness_diagnostics.png", dpi=110)
    plt.close(fig)


def report(runs: list[dict], losses: list[str], levels: list[int], seeds: int, settings: dict, minutes: float,
           out: Path, note: str = "", measured_on: dict | None = None) -> str:
    """Writes staleness.json (settings, summary, correlations, every run), staleness.md and the plots.
    `measured_on`: the machine record of the runs, when they were not measured just now."""
    rows, summary = summarise(runs, losses, levels)
    corr = correlations(runs)
    plot(runs, losses, levels, out)
    md = ["# Staleness study\n\n", note,
          f"Settings: {json.dumps(settings)}; losses {losses}; maximum staleness {levels}; {seeds} seed(s); "
          f"{minutes:.0f} min with {settings.get('workers', 1)} worker(s).\n",
          "Held-out pass@1 (T=1) on the arithmetic test split, in %, mean ± sd over seeds.\n\n",
          markdown_table(["loss", "max staleness", "best", "last", "best - last", "seeds"], rows),
          f"\n## Drop of last accuracy from staleness {min(levels)} to {max(levels)}\n\n",
          markdown_table(["loss", f"last @ {min(levels)}", f"last @ {max(levels)}", "drop (points)", "drop (relative)"],
                         drops(summary, losses, levels)),
          "\n## What the learner trained on: mean reward of its rollout groups and mean staleness, by level\n\n"
          "Stale groups come from older, weaker policies: no importance weight can add the signal they lack.\n\n",
          markdown_table(["max staleness", "train reward", "mean staleness (steps)"], training_data_by_level(runs, levels)),
          "\n## Late or wrong: where each stale run ended on its own loss's online curve\n\n"
          "The online step at which the same loss first reached the stale run's last accuracy, beside the step that the "
          "data's age alone predicts (steps - mean staleness of the last 10 steps' groups). Below the prediction: the loss "
          "lost more than the lag explains.\n\n",
          markdown_table(["loss", "max staleness", "last", "online step reaching it", "lag-only prediction"],
                         online_equivalent_steps(runs, losses, levels)),
          "\n## Diagnostics (Pearson correlation over all steps of all runs)\n\n",
          markdown_table(["pair", "r"], [[k, v] for k, v in corr.items()]),
          "\n## Error of the estimated expected advantage, by staleness (all losses' runs)\n\n"
          "|E_p[A] - E_q[w A]| per group, E_p[A] from fresh samples of the learner's policy (swarm/diagnostics.py).\n\n",
          markdown_table(["max staleness", "gepo weight", "sequence ratio", "token ratio", "steps"],
                         advantage_error_by_staleness(runs, levels)),
          "\nPlots: staleness_curves.png, staleness_diagnostics.png.\n"]
    figures = {"settings": settings, "minutes": minutes, "summary": summary, "correlations": corr, "runs": runs}
    write_result("staleness", {**figures, "machine": measured_on} if measured_on else figures, "".join(md), out)
    return "".join(md)


def report_again(out: Path) -> str:
    """Rewrites the report of a finished study from its staleness.json (after the analysis changed)."""
    result = json.loads((out / "staleness.json").read_text())
    runs, settings = result["runs"], result["settings"]
    settings.pop("out", None)  # older files kept an absolute path here
    losses = list(dict.fromkeys(r["loss"] for r in runs))
    levels = sorted({r["staleness"] for r in runs})
    # Older files lack the wall time; the runs' total over the workers comes close to it.
    minutes = result.get("minutes") or sum(r["seconds"] for r in runs) / 60 / settings.get("workers", 1)
    return report(runs, losses, levels, len({r["seed"] for r in runs}), settings, minutes, out,
                  measured_on=result.get("machine"))


def _start_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _run_job(job: tuple) -> dict:
    return run_one(*job)


def run_jobs(jobs: list[tuple], workers: int, on_result) -> None:
    """Runs (loss, staleness, seed, args) jobs, `workers` processes at a time.

    Tiny models use CPU threads poorly: two single-thread processes finish two runs in the time one
    two-thread process takes for one (measured on the 2-core CI machine), so the full study runs
    one process per core. Each run is seeded on its own, so results do not depend on the order.
    """
    threads = max(1, (os.cpu_count() or 1) // workers)
    if workers == 1:
        _start_worker(threads)
        for job in jobs:
            on_result(run_one(*job))
        return
    context = multiprocessing.get_context("spawn")  # no forked torch thread pools
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=(threads,)) as pool:
        for future in as_completed([pool.submit(_run_job, job) for job in jobs]):
            on_result(future.result())


# What a run's result depends on besides its loss, level and seed: a resumed study must keep these.
TRAINING_SETTINGS = ("steps", "prompts_per_step", "group_size", "lr", "eval_every", "advantage_every",
                     "eval_problems", "delay_shape")


def read_partial(partial: Path) -> tuple[dict | None, list[dict], int]:
    """(settings of the interrupted study or None for older files, its finished runs, lines unreadable).

    A study killed while writing leaves its last line cut short; that run is lost, not misread."""
    settings, runs, unreadable = None, [], 0
    for line in partial.read_text().splitlines():
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            unreadable += 1
            continue
        if "loss" in item:
            runs.append(item)
        elif "settings" in item:
            settings = item["settings"]
    return settings, runs, unreadable


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.staleness", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="gepo, grpo, gspo at staleness 0 and 64, one seed, short")
    parser.add_argument("--losses", default=None, help="comma-separated (default: all, or the quick set)")
    parser.add_argument("--staleness", default=None, help="comma-separated maximum staleness levels (default 0,8,64)")
    parser.add_argument("--delay-shape", choices=DELAY_SHAPES, default="uniform",
                        help="how each group's delay is drawn up to the maximum staleness K: uniform over 0..K (default), "
                             "always K, or the paper's log-normal between K/32 and K")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per loss and level (default 3, 1 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="learner steps per run (default 60, 40 with --quick)")
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4,
                        help="the same for every loss; 2e-4 is where staleness visibly hurts (README, 'Staleness study')")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--advantage-every", type=int, default=10,
                        help="every this many steps, the error of the estimated expected advantage (0: never)")
    parser.add_argument("--eval-problems", type=int, default=None,
                        help="held-out problems per evaluation (default 200 of the 500, 100 with --quick)")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                        help="runs in parallel, one process each (default: one per core, at most 2)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the results go (default benchmarks/results)")
    parser.add_argument("--from-partial", action="store_true",
                        help="only write the report from the runs an interrupted study left in staleness_runs.partial.jsonl")
    parser.add_argument("--resume", action="store_true",
                        help="finish an interrupted study: keep the runs in staleness_runs.partial.jsonl, run the rest")
    parser.add_argument("--report-only", action="store_true",
                        help="only rewrite the report (tables, plots) of the finished study in --out from its staleness.json")
    args = parser.parse_args(argv)
    if args.report_only:
        if not (args.out / "staleness.json").is_file():
            parser.error(f"--report-only: no {args.out / 'staleness.json'}; run the study first")
        print(report_again(args.out))
        return 0
    losses = args.losses.split(",") if args.losses else (["gepo", "grpo", "gspo"] if args.quick else ALL_LOSSES)
    levels = [int(x) for x in args.staleness.split(",")] if args.staleness else ([0, 64] if args.quick else [0, 8, 64])
    seeds = args.seeds or (1 if args.quick else 3)
    args.steps = args.steps or (40 if args.quick else 60)
    args.eval_problems = args.eval_problems or (100 if args.quick else 200)
    from swarm.losses import LOSSES

    unknown = [loss for loss in losses if loss not in LOSSES]
    if unknown or args.workers < 1 or any(k < 0 for k in levels):
        parser.error(f"unknown loss(es) {unknown}; choose from {sorted(LOSSES)}" if unknown else
                     "--workers must be >= 1 and staleness levels >= 0")
    out: Path = args.out
    partial = out / "staleness_runs.partial.jsonl"  # survives an interrupted study
    if (args.from_partial or args.resume) and not partial.is_file():
        flag = "--from-partial" if args.from_partial else "--resume"
        parser.error(f"{flag}: no {partial}; it is written while a study runs and removed when one finishes")
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "report_only", "resume")}  # out: no machine's paths
    earlier_settings, earlier, unreadable = read_partial(partial) if partial.is_file() else (None, [], 0)
    if earlier and not (args.from_partial or args.resume):
        parser.error(f"{partial} holds {len(earlier)} run(s) of an interrupted study: --resume finishes it, "
                     "--from-partial reports it, or delete the file to start over")
    if args.resume and args.from_partial:
        parser.error("--resume and --from-partial: choose one (finish the study, or report what it left)")
    planned = [(loss, k, seed) for seed in range(seeds) for k in levels for loss in losses]  # seed-major:
    # an interrupted study leaves whole seeds behind
    unplanned = sorted({(r["loss"], r["staleness"], r["seed"]) for r in earlier} - set(planned))
    if args.resume and unplanned:
        parser.error(f"--resume: the interrupted study has runs this one does not plan ({unplanned[:3]}"
                     f"{'...' if len(unplanned) > 3 else ''}); give "
                     "its --losses, --staleness and --seeds (or more of them)")
    if args.resume and earlier_settings:
        changed = [k for k in TRAINING_SETTINGS if earlier_settings.get(k) != settings.get(k)]
        if changed:
            parser.error("--resume: the interrupted study ran with other settings ("
                         + ", ".join(f"{k}={earlier_settings.get(k)!r}, now {settings.get(k)!r}" for k in changed)
                         + "); give the same options, or delete the file to start over")
    if unreadable:
        print(f"{partial}: {unreadable} line(s) cut short when the study was stopped; those runs are run again",
              file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    total = len(losses) * len(levels) * seeds
    started = time.time()

    def record(run: dict) -> None:
        runs.append(run)
        with partial.open("a") as f:
            f.write(json.dumps(run) + "\n")
        eta = (time.time() - started) / (len(runs) - resumed) * (total - len(runs))
        print(f"[{len(runs)}/{total}] {run['loss']:8s} staleness {run['staleness']:3d} seed {run['seed']}: "
              f"initial {run['initial']:.3f} best {run['best']:.3f} last {run['last']:.3f} "
              f"({run['seconds']:.0f}s; about {eta / 60:.0f} min left)", flush=True)

    if args.from_partial:
        runs = earlier
        losses = [l for l in losses if any(r["loss"] == l for r in runs)]
        levels = [k for k in levels if any(r["staleness"] == k for r in runs)]
        seeds = len({r["seed"] for r in runs})
    else:
        done = {(r["loss"], r["staleness"], r["seed"]): r for r in earlier} if args.resume else {}
        runs = [done[job] for job in planned if job in done]
        resumed, resumed_seconds = len(runs), sum(r["seconds"] for r in runs)
        if resumed:
            print(f"resuming: {resumed} of {total} runs already done", flush=True)
        partial.write_text("".join(json.dumps(line) + "\n" for line in [{"settings": settings}, *runs]))
        run_jobs([(*job, args) for job in planned if job not in done], args.workers, record)
    runs.sort(key=lambda r: (r["seed"], levels.index(r["staleness"]), losses.index(r["loss"])))
    if args.from_partial:
        note = f"**Interrupted study: {len(runs)} of {total} planned runs.** "
        minutes = sum(r["seconds"] for r in runs) / 60 / args.workers
    else:  # a resumed study adds the earlier runs' time as if it had not stopped
        note = ""
        minutes = (time.time() - started) / 60 + resumed_seconds / 60 / args.workers
    md = report(runs, losses, levels, seeds, settings, minutes, out, note)
    if not args.from_partial:
        partial.unlink()
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
