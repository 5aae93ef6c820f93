"""The staleness study (GEPO paper, Table 1 at small scale): every registered loss trained on
rollouts from past versions of its own policy, at several maximum staleness levels and seeds,
with held-out accuracy every few steps.

    python -m benchmarks.staleness --quick     # a few minutes: gepo, grpo, gspo; staleness 0 and 64; 1 seed; 40 steps
    python -m benchmarks.staleness             # the full study: 8 losses x {0, 8, 64} x 3 seeds; 60 steps

Staleness K means each virtual sampler's delay is drawn uniformly from 0..K steps (or, with
--delay-shape, always K or log-normal as in the paper), capped by the versions that exist; K = 0 is
online RL. --drop-older-than J drops groups more than J steps old (prime-rl's rule) and trains on
fresher ones instead. Seeds, prompts, schedule and evaluation are the same for every loss, so
differences come from the loss alone. Writes benchmarks/results/staleness.json, staleness.md,
staleness_curves.png and staleness_diagnostics.png.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import yaml

from benchmarks.common import RESULTS
from swarm.progress import progress_for
from benchmarks.staleness_report import report, report_again

ALL_LOSSES = ["gepo", "grpo", "gspo", "dr_grpo", "bnpo", "gmpo", "topr", "cispo", "m2po", "decoupled_ppo", "tis_mis", "opsm"]


DELAY_SHAPES = ("uniform", "fixed", "lognormal")

# A bare loss name in the study means its paper's form, whatever the swarm's defaults: GEPO's default
# clip became weight+token-neg on this study's evidence, and the label "gepo" keeps meaning the paper
# so that stages run before and after that change combine (the variant is gepo[gepo_clip=weight+token-neg]).
PAPER_FORM: dict[str, dict] = {"gepo": {"gepo_clip": "weight"}, "topr": {"topr_form": "paper"}}


def delay_spec(shape: str, staleness: int, drop_older_than: int | None = None) -> str:
    """The delay distribution (swarm/staleness.py) of maximum staleness K in the given shape.

    lognormal keeps the paper's proportions: delays of 60..1920 s at 30 s per step are 2..64 steps,
    so K steps becomes a log-normal between K/32 and K steps (K * 30 / 32 .. K * 30 s at 30 s/step).
    With `drop_older_than` J < K, groups more than J steps old are dropped and replaced by fresher ones
    (prime-rl's rule, J = 8 there).
    """
    if staleness == 0:
        return "none"
    spec = f"lognormal:{staleness * 30 / 32:g},{staleness * 30},30" if shape == "lognormal" else f"{shape}:{staleness}"
    return spec if drop_older_than is None or drop_older_than >= staleness else f"{spec}/drop:{drop_older_than}"


def split_losses(text: str) -> list[str]:
    """`--losses` entries: commas separate losses, except inside a variant's brackets."""
    return [m.strip() for m in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", text) if m.strip()]


# Optimizer settings a variant may change besides its loss's (e.g. topr[max_grad_norm=0]); the
# learning rate is the study's own (--lr), the same for every loss.
OPTIMIZER_KEYS = ("max_grad_norm", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon")


def variant_settings(spec: str) -> tuple[dict, dict]:
    """The LossConfig and the optimizer overrides of a `--losses` entry: a registered loss's name (its
    paper's form and defaults), or a variant NAME[key=value;key=value] (e.g.
    gepo[gepo_clip=weight+token-neg] or topr[max_grad_norm=0]), the entry being the variant's label in
    every table. Raises ValueError naming what is wrong."""
    from pydantic import ValidationError

    from swarm.config import LossConfig, TrainerConfig

    found = re.fullmatch(r"(\w+)(?:\[([^\]]*)\])?", spec)
    if found is None:
        raise ValueError(f"bad loss {spec!r}: a loss name, or NAME[key=value;...]")
    settings: dict = {"name": found[1], **PAPER_FORM.get(found[1], {})}
    optimizer: dict = {}
    for item in filter(None, (found[2] or "").split(";")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"bad setting {item!r} in {spec!r}: key=value")
        # numbers as numbers, words as strings
        (optimizer if key.strip() in OPTIMIZER_KEYS else settings)[key.strip()] = yaml.safe_load(value.strip())
    try:
        LossConfig(**settings)
        TrainerConfig(**optimizer)
    except ValidationError as exc:
        raise ValueError(f"{spec}: {'; '.join(e['msg'] + ' at ' + '.'.join(map(str, e['loc'])) for e in exc.errors())}") from None
    return settings, optimizer


def run_one(loss: str, staleness: int, seed: int, args) -> dict:
    from peers.trainer import run_trainer
    from swarm.config import TrainerConfig

    loss_config, optimizer = variant_settings(loss)
    config = TrainerConfig(
        loss=loss_config, **optimizer, steps=args.steps, groups_per_step=args.prompts_per_step, num_generations=args.group_size,
        learning_rate=args.lr, max_staleness=max(staleness, 0),
        delay=delay_spec(getattr(args, "delay_shape", "uniform"), staleness, getattr(args, "drop_older_than", None)),
        eval_every=args.eval_every, eval_problems=args.eval_problems, eval_samples=1, seed=seed,
        advantage_diagnostic_every=args.advantage_every,
    )
    started = time.time()
    result = run_trainer(config)
    keep = ("step", "reward_mean", "staleness_mean", "staleness_max", "kl_learner_sampler", "kl_sampler_learner",
            "is_weight_var", "is_weight_mean", "clip_frac", "loss", "grad_norm", "adv_err_gepo", "adv_err_seq", "adv_err_token")
    history = [{k: h[k] for k in keep if k in h} for h in result["history"]]
    accs = [e["pass_at_1"] for e in result["evals"]]
    return {"loss": loss, "staleness": staleness, "seed": seed, "evals": result["evals"], "history": history,
            "best": max(accs[1:] or accs), "last": accs[-1], "initial": accs[0], "seconds": time.time() - started}




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
    No more workers than jobs: a worker is a fresh interpreter importing torch and transformers
    (about 5 CPU s on the 2-core machine), so one job (a resumed stage's last run) runs here.
    """
    workers = max(1, min(workers, len(jobs)))
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
                     "eval_problems", "delay_shape", "drop_older_than")


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


def check_interrupted_study(parser, args, partial: Path, planned: list[tuple], settings: dict) -> list[dict]:
    """The finished runs an interrupted study left in `partial`, after refusing what would lose or
    mix them: starting over them, resuming with other settings, or resuming without some of them."""
    if args.resume and args.from_partial:
        parser.error("--resume and --from-partial: choose one (finish the study, or report what it left)")
    if (args.from_partial or args.resume) and not partial.is_file():
        flag = "--from-partial" if args.from_partial else "--resume"
        parser.error(f"{flag}: no {partial}; it is written while a study runs and removed when one finishes")
    earlier_settings, earlier, unreadable = read_partial(partial) if partial.is_file() else (None, [], 0)
    if earlier and not (args.from_partial or args.resume):
        parser.error(f"{partial} holds {len(earlier)} run(s) of an interrupted study: --resume finishes it, "
                     "--from-partial reports it, or delete the file to start over")
    if args.resume:
        unplanned = sorted({(r["loss"], r["staleness"], r["seed"]) for r in earlier} - set(planned))
        if unplanned:
            parser.error(f"--resume: the interrupted study has runs this one does not plan ({unplanned[:3]}"
                         f"{'...' if len(unplanned) > 3 else ''}); give its --losses, --staleness and --seeds "
                         "(or more of them)")
        changed = [k for k in TRAINING_SETTINGS if earlier_settings and earlier_settings.get(k) != settings.get(k)]
        if changed:
            parser.error("--resume: the interrupted study ran with other settings ("
                         + ", ".join(f"{k}={earlier_settings.get(k)!r}, now {settings.get(k)!r}" for k in changed)
                         + "); give the same options, or delete the file to start over")
    if unreadable:
        fate = "those runs are run again" if args.resume else "those runs are missing from the report"
        print(f"{partial}: {unreadable} line(s) cut short when the study was stopped; {fate}", file=sys.stderr)
    return earlier


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.staleness", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="gepo, grpo, gspo at staleness 0 and 64, one seed, short")
    parser.add_argument("--losses", default=None,
                        help="comma-separated (default: all, or the quick set); a variant of a loss with its own settings "
                             "is NAME[key=value;...], e.g. gepo[gepo_clip=weight+token-neg] or topr[max_grad_norm=0] "
                             f"(loss settings, and the optimizer's {', '.join(OPTIMIZER_KEYS)}), labelled so in the tables")
    parser.add_argument("--staleness", default=None, help="comma-separated maximum staleness levels (default 0,8,64)")
    parser.add_argument("--delay-shape", choices=DELAY_SHAPES, default="uniform",
                        help="how each group's delay is drawn up to the maximum staleness K: uniform over 0..K (default), "
                             "always K, or the paper's log-normal between K/32 and K")
    parser.add_argument("--drop-older-than", type=int, default=None, metavar="J",
                        help="drop groups more than J steps old (prime-rl's rule, J = 8 there); a step still trains on "
                             "--prompts-per-step groups, fresher ones: the cost is sampling, reported as the share dropped")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per loss and level (default 3, 1 with --quick)")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="the first seed (a later stage adding seeds 3-5 to a study of seeds 0-2: --first-seed 3)")
    parser.add_argument("--combine", type=Path, nargs="+", default=None, metavar="DIR",
                        help="only write one report into --out from the finished studies (stages) in these directories: "
                             "their runs together, each (loss, staleness, seed) once; they must share the training "
                             "settings")
    parser.add_argument("--steps", type=int, default=None, help="learner steps per run (default 60, 40 with --quick)")
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4,
                        help="the same for every loss; 2e-4 is where staleness visibly hurts (docs/staleness.md)")
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
    if args.combine:
        print(combine(parser, args.combine, args.out))
        return 0
    losses = split_losses(args.losses) if args.losses else (["gepo", "grpo", "gspo"] if args.quick else ALL_LOSSES)
    levels = [int(x) for x in args.staleness.split(",")] if args.staleness else ([0, 64] if args.quick else [0, 8, 64])
    seeds = args.seeds or (1 if args.quick else 3)
    args.steps = args.steps or (40 if args.quick else 60)
    args.eval_problems = args.eval_problems or (100 if args.quick else 200)
    from swarm.config.settings import LOSS_NAMES  # (swarm.losses would import torch before a bad option is named)

    unknown = [loss for loss in losses if (re.match(r"\w+", loss) or [""])[0] not in LOSS_NAMES]
    if unknown or args.workers < 1 or args.first_seed < 0 or any(k < 0 for k in levels):
        parser.error(f"unknown loss(es) {unknown}; choose from {sorted(LOSS_NAMES)}" if unknown else
                     "--workers must be >= 1, --first-seed and staleness levels >= 0")
    for loss in losses:
        try:
            variant_settings(loss)
        except ValueError as exc:
            parser.error(f"--losses: {exc}")
    if args.drop_older_than is not None:
        from swarm.staleness import DelayDistribution

        if args.drop_older_than < 0:
            parser.error("--drop-older-than must be >= 0")
        try:
            dropped = {k: DelayDistribution.parse(delay_spec(args.delay_shape, k, args.drop_older_than)).dropped_fraction()
                       for k in levels}
        except ValueError as exc:
            parser.error(f"--drop-older-than {args.drop_older_than}: {exc}")
        print("groups dropped as older than {} steps (sampling wasted): {}".format(
            args.drop_older_than, ", ".join(f"{100 * f:.0f}% at staleness {k}" for k, f in dropped.items())), flush=True)
    out: Path = args.out
    partial = out / "staleness_runs.partial.jsonl"  # survives an interrupted study
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "report_only", "resume")}  # out: no machine's paths
    if args.drop_older_than is not None:  # what dropping costs, recorded with the results
        settings["dropped_share"] = {str(k): round(f, 4) for k, f in dropped.items()}
    planned = [(loss, k, seed) for seed in range(args.first_seed, args.first_seed + seeds)
               for k in levels for loss in losses]  # seed-major:
    # an interrupted study leaves whole seeds behind
    earlier = check_interrupted_study(parser, args, partial, planned, settings)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    total = len(losses) * len(levels) * seeds
    started = time.time()
    # on a terminal, an overall bar under the runs' lines; elsewhere the lines alone (they count already)
    progress = progress_for(sys.stdout)
    bar = None

    def record(run: dict) -> None:
        runs.append(run)
        with partial.open("a") as f:
            f.write(json.dumps(run) + "\n")
        eta = (time.time() - started) / (len(runs) - resumed) * (total - len(runs))
        line = (f"[{len(runs)}/{total}] {run['loss']:8s} staleness {run['staleness']:3d} seed {run['seed']}: "
                f"initial {run['initial']:.3f} best {run['best']:.3f} last {run['last']:.3f} "
                f"({run['seconds']:.0f}s; about {eta / 60:.0f} min left)")
        if bar is None:
            print(line, flush=True)
        else:
            progress.echo(line)
            bar.update(completed=len(runs), note=f"about {eta / 60:.0f} min left")

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
        if progress.terminal:
            bar = progress.task("staleness study", total=total, unit="runs", keep=True)
            bar.update(completed=resumed)
        try:
            run_jobs([(*job, args) for job in planned if job not in done], args.workers, record)
        finally:
            if bar is not None:
                bar.close()
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


def combine(parser, dirs: list[Path], out: Path) -> str:
    """One report from several finished studies (the stages of a study too long for one sitting):
    their runs together, refusing stages with other training settings and a (loss, staleness, seed)
    that two stages ran to different results."""

    runs: dict[tuple, dict] = {}
    settings, minutes, stages = None, 0.0, []
    for d in dirs:
        path = d / "staleness.json"
        if not path.is_file():
            parser.error(f"--combine: no {path}; give directories of finished studies")
        result = json.loads(path.read_text())
        own = result["settings"]
        if settings is None:
            settings = dict(own)
        changed = [k for k in TRAINING_SETTINGS if own.get(k) != settings.get(k)]
        if changed:
            parser.error(f"--combine: {d} ran with other settings than {dirs[0]} ("
                         + ", ".join(f"{k}={own.get(k)!r} against {settings.get(k)!r}" for k in changed) + ")")
        for run in result["runs"]:
            key = (run["loss"], run["staleness"], run["seed"])
            if key in runs and [e["pass_at_1"] for e in runs[key]["evals"]] != [e["pass_at_1"] for e in run["evals"]]:
                parser.error(f"--combine: {key} was run by two stages to different results; rerun one of them")
            runs.setdefault(key, run)
        minutes += result.get("minutes") or 0.0
        # a combined report given again lists the stages it was made of, not itself
        stages.extend(own.get("combined") or [f"{d.name} ({len(result['runs'])} runs)"])
    merged = list(runs.values())
    losses = list(dict.fromkeys(r["loss"] for r in merged))
    levels = sorted({r["staleness"] for r in merged})
    seeds = len({r["seed"] for r in merged})
    settings.update(losses=",".join(losses), staleness=",".join(map(str, levels)), seeds=seeds, combined=stages)
    out.mkdir(parents=True, exist_ok=True)
    note = (f"**Combined from {len(stages)} stages** ({', '.join(stages)}): seeds differ by loss and level, as each "
            "row's seeds column says.\n\n")
    return report(merged, losses, levels, seeds, settings, minutes, out, note)


if __name__ == "__main__":
    raise SystemExit(main())
