"""`swarm demo`: a real swarm on this machine (bootstrap, learner and samplers as processes on
127.0.0.1) with a live view, then held-out accuracy before and after and a plot; or, with
--in-process, the in-process trainer (staleness simulated by a delay distribution; no network).

The live view reads what the peers write to their run directories (the learner's steps.jsonl, the
samplers' events.jsonl), never their printed output. Every setting comes from `DemoConfig`; the
swarm's peers get theirs through one config file written to the run directory (swarm.yaml).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from swarm.cli.launcher import LocalSwarm
from swarm.cli.plots import plot_run
from swarm.config import DemoConfig, LearnerConfig, SamplerConfig, TaskSettings, TrainingSettings, default_of
from swarm.config.settings import ReportSettings
from swarm.progress import progress_for
from swarm.runlog import EVENTS_FILE, STEPS_FILE, read_jsonl
from swarm.signals import stopped_by

# What the demo's samplers are told beyond the shared settings, and how often they report.
SAMPLER_SETTINGS = ("num_generations", "prompts_per_round", "pickup_delay")
# The run's sampling settings: the learner announces them and samplers generate with them
RUN_SAMPLING = ("temperature", "top_k", "top_p", "max_completion_length")
PROGRESS_EVERY_S = 2.0
# How long the learner may take to be ready; its samplers, started beside it, wait that much longer for its
# first version than a sampler started by hand does (SamplerConfig.wait_s), rather than give up first
LEARNER_READY_S = 120.0


def peer_settings(config: DemoConfig) -> dict:
    """The config file the demo's peers share: task at the top, [learner] and [sampler] tables."""
    dumped = json.loads(config.model_dump_json())
    learner = {k: dumped[k] for k in (*TrainingSettings.model_fields, *RUN_SAMPLING) if k in LearnerConfig.model_fields}
    learner["checkpoint_every"] = 0  # one checkpoint, at the end: the one evaluated
    sampler = {k: dumped[k] for k in SAMPLER_SETTINGS if k in SamplerConfig.model_fields}
    sampler["progress_every_s"] = PROGRESS_EVERY_S
    sampler["wait_s"] = default_of(SamplerConfig, "wait_s") + LEARNER_READY_S
    shared = {k: dumped[k] for k in (*TaskSettings.model_fields, *ReportSettings.model_fields)}  # --report-to: every peer
    return {**shared, "learner": learner, "sampler": sampler}


def _eval(model: str, config: DemoConfig) -> dict:
    from swarm.evaluation import evaluate  # torch: imported when the demo runs, not at `swarm --help`

    result = evaluate(model, config.task, limit=config.eval_problems, samples=config.eval_samples,
                      temperature=config.temperature, max_completion_length=config.max_completion_length,
                      seed=config.seed, task_options=config.task_options())
    return {"pass_at_1": result.pass_at_1, "greedy_accuracy": result.greedy_accuracy}


def _last_event(run_dir: Path, kind: str) -> dict:
    return next((e for e in reversed(read_jsonl(run_dir / EVENTS_FILE)) if e.get("event") == kind), {})


def _view(config: DemoConfig, steps: list[dict], swarm, started: float):
    from rich.table import Table

    last = steps[-1] if steps else {}
    table = Table(title=f"swarm demo: {config.loss.name}, {len(steps)}/{config.steps} learner steps, {time.time() - started:.0f}s")
    for col in ("peer", "version", "behind", "reward", "staleness mean/max", "groups/s", "accepted / used"):
        table.add_column(col, justify="right")
    if last:
        table.add_row("learner", str(int(last["version"])), "0", f"{last['reward_mean']:.3f}",
                      f"{last['staleness_mean']:.1f} / {last['staleness_max']:.0f}", "", str(last.get("used_total", "")))
    for proc in swarm.procs:
        if proc.name.startswith("sampler"):
            progress = _last_event(proc.run_dir, "progress")
            if progress:
                table.add_row(proc.name, str(progress["version"]), str(progress["behind"]), "", "",
                              f"{progress['groups_per_s']:.1f}", str(progress["accepted"]))
            else:
                table.add_row(proc.name, "starting", "", "", "", "", "")
    return table


def run_swarm_demo(config: DemoConfig, run_dir: Path, *, console) -> dict:
    """Start the swarm, show it train until the learner reaches `steps`, stop everything, evaluate.
    Ctrl-C stops the swarm early: what the learner trained so far is evaluated all the same (its
    checkpoint on the way out) and the result says `interrupted`; a second Ctrl-C, or SIGTERM,
    skips that (KeyboardInterrupt)."""
    import yaml
    from rich.live import Live

    from swarm.checkpoint import latest_checkpoint  # torch: imported when the demo runs, not at `swarm --help`

    console.print(f"[bold]swarm demo[/]: a bootstrap node, a learner ({config.loss.name}) and {config.samplers} samplers as "
                  f"processes on 127.0.0.1 over {config.transport}; logs in {run_dir / 'logs'}")
    console.print(f"accuracy of {config.model} before training (held-out {config.task} test split) ...")
    before = _eval(config.model, config)
    settings = run_dir / "swarm.yaml"
    settings.write_text(yaml.safe_dump(peer_settings(config), sort_keys=False))
    swarm = LocalSwarm(run_dir, transport=config.transport)
    started, interrupted, learner = time.time(), False, None
    try:
        peers = swarm.start_bootstrap()
        # the learner and its samplers start together (seconds of imports and loading each, in processes of their
        # own): the learner's key, which samplers are given, is made here first, as `swarm learner-key` does
        key = swarm.learner_key()
        learner = swarm.spawn_learner(peers, "--config", str(settings))
        steps_file = learner.run_dir / STEPS_FILE
        for i in range(config.samplers):
            swarm.start_sampler(f"sampler-{i}", peers, key, "--config", str(settings))
        if swarm.wait_ready(learner, timeout=LEARNER_READY_S)["learner_key"] != key:
            raise RuntimeError(f"the learner runs with another key than the one made in {swarm.learner_identity_dir} for "
                               f"its samplers: is another learner running from that directory? See {learner.log}")
        with Live(console=console, refresh_per_second=2) as live:
            while learner.popen.poll() is None:
                for proc in swarm.procs:
                    if proc.popen.poll() not in (None, 0):
                        raise RuntimeError(f"{proc.name} exited with status {proc.popen.returncode}; its log {proc.log} "
                                           f"ends with:\n{proc.text()[-1500:]}")
                live.update(_view(config, read_jsonl(steps_file), swarm, started))
                time.sleep(0.5)
            live.update(_view(config, read_jsonl(steps_file), swarm, started))
        console.print()
        if learner.popen.returncode != 0:
            raise RuntimeError(f"the learner exited with status {learner.popen.returncode}; see {learner.log}")
    except KeyboardInterrupt:  # Ctrl-C (or SIGTERM): stop the swarm; after a Ctrl-C, evaluate what it trained
        if stopped_by() != signal.SIGINT or learner is None:
            swarm.stop_all()
            raise
        interrupted = True
        console.print("\nCtrl-C: stopping the swarm (the learner saves a checkpoint), then evaluating it; "
                      "Ctrl-C again skips the evaluation")
    finally:
        swarm.stop_all()
    trained_seconds = time.time() - started
    final = latest_checkpoint(learner.run_dir)
    if final is None:
        if interrupted:
            console.print(f"nothing to evaluate: the learner left no checkpoint in {learner.run_dir}")
            raise KeyboardInterrupt
        raise RuntimeError(f"the learner left no checkpoint in {learner.run_dir}; see {run_dir / 'logs'}")
    console.print(f"accuracy of version {final.version} ({final.path}) ...")
    after = _eval(str(final.path), config)
    history = [{"step": int(s["version"]), "reward_mean": s["reward_mean"], "staleness_mean": s["staleness_mean"],
                "staleness_max": s["staleness_max"]} for s in read_jsonl(steps_file)]
    evals = [{"step": 0, **before}, {"step": final.version, **after}]
    (run_dir / "evals.json").write_text(json.dumps(evals, indent=2))
    plot = plot_run(history, evals, run_dir / "training.png", f"swarm demo: {config.loss.name}, {config.samplers} samplers")
    return {"before": before, "after": after, "version": final.version, "checkpoint": str(final.path), "plot": str(plot),
            "seconds": trained_seconds, "interrupted": interrupted}


def print_result(console, config: DemoConfig, before: dict, after: dict, version: int, run_dir: Path, files: str) -> None:
    from rich.table import Table

    table = Table(title=f"held-out accuracy ({config.task} test split, {config.eval_problems} problems), version 0 -> {version}")
    for col in ("", "before", "after"):
        table.add_column(col, justify="right")
    table.add_row(f"pass@1 (k={config.eval_samples}, T={config.temperature:g})", f"{100 * before['pass_at_1']:.1f}%",
                  f"{100 * after['pass_at_1']:.1f}%")
    table.add_row("greedy", f"{100 * before['greedy_accuracy']:.1f}%", f"{100 * after['greedy_accuracy']:.1f}%")
    console.print(table)
    console.print(f"run directory: {run_dir}  ({files})")


def run_in_process_demo(config: DemoConfig, run_dir: Path) -> dict:
    """Sampler and learner in this process (peers/trainer.py); staleness simulated by `config.delay`."""
    import sys

    from rich.console import Console

    from peers.trainer import run_trainer  # torch: imported when the demo runs, not at `swarm --help`

    console = Console(stderr=True)
    console.print(f"[bold]swarm demo[/]: {config.loss.name} on {config.model}, {config.steps} steps of "
                  f"{config.groups_per_step} prompts x {config.num_generations} completions, delay {config.delay}")
    # a bar on a terminal (the evaluations' beside it), plain lines in a log
    progress = progress_for(sys.stderr, transient=False)
    with progress.task("training", total=config.steps, unit="steps", keep=True) as job:
        state = {"eval": ""}

        def on_step(m):
            job.advance(1)
            job.update(note=f"reward {m['reward_mean']:.2f}  staleness {m['staleness_mean']:.1f}  {state['eval']}")

        def on_eval(e):
            state["eval"] = f"held-out pass@1 {e['pass_at_1']:.2f} (step {e['step']})"
            job.update(note=state["eval"])

        result = run_trainer(config.trainer_config(), run_dir=run_dir, on_step=on_step, on_eval=on_eval, progress=progress)
    (run_dir / "evals.json").write_text(json.dumps(result["evals"], indent=2))
    plot = plot_run(result["history"], result["evals"], run_dir / "training.png", f"{config.loss.name}, delay {config.delay}")
    return {"before": result["evals"][0], "after": result["evals"][-1], "version": config.steps, "plot": str(plot)}
