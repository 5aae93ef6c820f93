"""The staleness study's report: tables (Table 1 of the GEPO paper at small scale), the diagnostics
and their correlations, where each stale run ended on its loss's online curve, and the plots.
Reads the runs that benchmarks/staleness.py produced; trains nothing."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.common import markdown_table, write_result


def runs_of(runs: list[dict], loss: str, level: int) -> list[dict]:
    """The runs (one per seed) of one loss at one maximum staleness."""
    return [r for r in runs if r["loss"] == loss and r["staleness"] == level]


def summarise(runs: list[dict], losses: list[str], levels: list[int]) -> tuple[list[list], dict]:
    def mean_sd(values):
        return (statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0)

    rows, summary = [], {}
    for loss in losses:
        for k in levels:
            sel = runs_of(runs, loss, k)
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


def by_level(runs: list[dict], losses: list[str], levels: list[int], key: str) -> list[list]:
    """One row per loss, one column per staleness level: `key` (best or last pass@1, %) as mean ± sd
    over seeds, with the seed count where it is not the same in every cell; then, for `last`, the
    drop from online at each stale level, paired by seed (the same prompts at every level), so its
    error bar is the spread of the per-seed drops."""
    def cell(values):
        if not values:
            return "-"
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{100 * statistics.mean(values):.1f} ± {100 * sd:.1f}"

    counts = {len(runs_of(runs, loss, k)) for loss in losses for k in levels} - {0}
    rows = []
    for loss in losses:
        per_level = {k: {r["seed"]: r[key] for r in runs_of(runs, loss, k)} for k in levels}
        row = [loss] + [cell(list(per_level[k].values())) + (f" ({len(per_level[k])})" if len(counts) > 1 and per_level[k] else "")
                        for k in levels]
        if key == "last" and min(levels) == 0:
            for k in levels[1:]:
                seeds = sorted(set(per_level[0]) & set(per_level[k]))
                if not seeds:
                    row.append("-")
                    continue
                diffs = [per_level[0][seed] - per_level[k][seed] for seed in seeds]
                online = statistics.mean(per_level[0][seed] for seed in seeds)
                sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
                row.append(f"{100 * statistics.mean(diffs):.1f} ± {100 * sd:.1f} "
                           f"({100 * statistics.mean(diffs) / online:.0f}%)" if online else "-")
        rows.append(row)
    return rows


def by_level_header(levels: list[int], key: str) -> list[str]:
    header = ["loss"] + [f"{key} @ {k}" for k in levels]
    if key == "last" and min(levels) == 0:
        header += [f"drop @ {k}" for k in levels[1:]]
    return header


def mean_curve(runs: list[dict], loss: str, level: int) -> list[tuple[int, float]]:
    """(step, pass@1 averaged over seeds) at every evaluation of one loss at one staleness level."""
    sel = runs_of(runs, loss, level)
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
            tail = [h["staleness_mean"] for r in runs_of(runs, loss, k) for h in r["history"] if h["step"] > steps - 10]
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


def stability_by_loss(runs: list[dict], losses: list[str], levels: list[int]) -> list[list]:
    """Per loss and level, over every step of its runs: mean KL(learner || sampler), importance-weight
    variance and clip fraction, and the gradient norm before clipping (median, 95th percentile,
    largest): a spike is a step that clipping to max_grad_norm had to rescue."""
    rows = []
    for loss in losses:
        for k in levels:
            hs = [h for r in runs_of(runs, loss, k) for h in r["history"]]
            if not hs:
                continue
            row = [loss, k] + [statistics.mean(h[m] for h in hs) for m in ("kl_learner_sampler", "is_weight_var", "clip_frac")]
            norms = sorted(h["grad_norm"] for h in hs if "grad_norm" in h)  # older studies did not keep it
            row += [norms[len(norms) // 2], norms[int(0.95 * (len(norms) - 1))], norms[-1]] if norms else ["-"] * 3
            rows.append(row)
    return rows


def plot(runs: list[dict], losses: list[str], levels: list[int], out) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One accuracy scale for every staleness level, so that the drop shows.
    fig, axes = plt.subplots(1, len(levels), figsize=(5 * len(levels), 4), squeeze=False, sharey=True)
    for ax, k in zip(axes[0], levels):
        for i, loss in enumerate(losses):
            sel = runs_of(runs, loss, k)
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
          "\n## Last pass@1 by loss and staleness, and the drop from online (paired by seed: points, relative)\n\n",
          markdown_table(by_level_header(levels, "last"), by_level(runs, losses, levels, "last")),
          "\n## Best pass@1 by loss and staleness\n\n",
          markdown_table(by_level_header(levels, "best"), by_level(runs, losses, levels, "best")),
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
          "\n## Stability, by loss and level (every step of every seed)\n\n"
          "Importance-weight variance is of each loss's own weight (GEPO's group weight, GSPO's length-normalised "
          "sequence ratio, token ratios otherwise); gradient norms are before clipping to max_grad_norm.\n\n",
          markdown_table(["loss", "max staleness", "KL per token", "IS-weight var", "clip fraction", "grad norm median",
                          "p95", "max"], stability_by_loss(runs, losses, levels)),
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
