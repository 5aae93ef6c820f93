"""`swarm demo`: a whole swarm on this machine (bootstrap, learner and samplers as separate
processes on loopback) training the embedded policy, with a live view, accuracy before and after,
and a plot; or, with --in-process, the same training in one process (staleness simulated by a
delay distribution; no network)."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

SAMPLER_PROGRESS = re.compile(r"version (\d+) \((\d+) behind\), ([\d.]+) groups/s, (\d+) tokens/s, (\d+) accepted")


@dataclass
class SwarmDemoOptions:
    steps: int = 60
    loss: str = "gepo"
    lr: float = 1e-4
    groups_per_step: int = 32
    group_size: int = 8
    samplers: int = 2
    prompts_per_round: int = 8
    pickup_delay: str = "none"
    eval_problems: int = 200
    eval_samples: int = 2
    max_new_tokens: int = 16
    transport: str = "hivemind"


def _eval(model: str, options: SwarmDemoOptions) -> dict:
    from swarm.evaluation import evaluate

    result = evaluate(model, "arithmetic", limit=options.eval_problems, samples=options.eval_samples,
                      max_new_tokens=options.max_new_tokens, show_progress=False, task_options={"difficulty": 2})
    return {"pass_at_1": result.pass_at_1, "greedy_accuracy": result.greedy_accuracy}


def _read_steps(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    steps = []
    for line in lines:
        try:
            steps.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return steps


def _view(options: SwarmDemoOptions, steps: list[dict], swarm, started: float):
    from rich.table import Table

    last = steps[-1] if steps else {}
    table = Table(title=f"swarm demo: {options.loss}, {len(steps)}/{options.steps} learner steps, {time.time() - started:.0f}s")
    for col in ("peer", "version", "behind", "reward", "staleness mean/max", "groups/s", "accepted / used"):
        table.add_column(col, justify="right")
    if last:
        table.add_row("learner", str(int(last["version"])), "0", f"{last['reward_mean']:.3f}",
                      f"{last['staleness_mean']:.1f} / {last['staleness_max']:.0f}", "", str(last.get("used_total", "")))
    for proc in swarm.procs:
        if proc.name.startswith("sampler"):
            found = SAMPLER_PROGRESS.findall(proc.text())
            if found:
                version, behind, rate, _, accepted = found[-1]
                table.add_row(proc.name, version, behind, "", "", rate, accepted)
            else:
                table.add_row(proc.name, "starting", "", "", "", "", "")
    return table


def run_swarm_demo(options: SwarmDemoOptions, run_dir: Path, *, console) -> dict:
    """Start the swarm, show it train until the learner reaches `steps`, stop everything, evaluate."""
    from rich.live import Live

    from swarm.checkpoint import latest_checkpoint
    from swarm.local_swarm import LocalSwarm
    from swarm.plots import plot_run

    console.print(f"[bold]swarm demo[/]: a bootstrap node, a learner ({options.loss}) and {options.samplers} samplers as "
                  f"processes on 127.0.0.1 over {options.transport}; logs in {run_dir / 'logs'}")
    console.print("accuracy of the embedded policy before training (held-out test split) ...")
    before = _eval("embedded", options)
    swarm = LocalSwarm(run_dir, transport=options.transport)
    started = time.time()
    try:
        peers = swarm.start_bootstrap()
        learner, key = swarm.start_learner(
            peers, "--steps", str(options.steps), "--loss", options.loss, "--lr", str(options.lr),
            "--groups-per-step", str(options.groups_per_step), "--run-dir", str(run_dir / "learner"), "--checkpoint-every", "0")
        for i in range(options.samplers):
            swarm.start_sampler(f"sampler-{i}", peers, key, "--prompts-per-round", str(options.prompts_per_round),
                                "--group-size", str(options.group_size), "--max-new-tokens", str(options.max_new_tokens),
                                "--pickup-delay", options.pickup_delay, "--progress-every-s", "2")
        steps_file = run_dir / "learner" / "steps.jsonl"
        with Live(console=console, refresh_per_second=2) as live:
            while learner.popen.poll() is None:
                for proc in swarm.procs:
                    if proc.popen.poll() not in (None, 0):
                        raise RuntimeError(f"{proc.name} exited with status {proc.popen.returncode}; its log {proc.log} "
                                           f"ends with:\n{proc.text()[-1500:]}")
                live.update(_view(options, _read_steps(steps_file), swarm, started))
                time.sleep(0.5)
            live.update(_view(options, _read_steps(steps_file), swarm, started))
        console.print()
        if learner.popen.returncode != 0:
            raise RuntimeError(f"the learner exited with status {learner.popen.returncode}; see {learner.log}")
    finally:
        swarm.stop_all()
    trained_seconds = time.time() - started
    final = latest_checkpoint(run_dir / "learner")
    if final is None:
        raise RuntimeError(f"the learner left no checkpoint in {run_dir / 'learner'}; see {run_dir / 'logs'}")
    console.print(f"accuracy of version {final.version} ({final.path}) ...")
    after = _eval(str(final.path), options)
    steps = _read_steps(run_dir / "learner" / "steps.jsonl")
    history = [{"step": int(s["version"]), "reward_mean": s["reward_mean"], "staleness_mean": s["staleness_mean"],
                "staleness_max": s["staleness_max"]} for s in steps]
    evals = [{"step": 0, **before}, {"step": final.version, **after}]
    (run_dir / "evals.json").write_text(json.dumps(evals, indent=2))
    plot = plot_run(history, evals, run_dir / "training.png", f"swarm demo: {options.loss}, {options.samplers} samplers")
    return {"before": before, "after": after, "version": final.version, "checkpoint": str(final.path), "plot": str(plot),
            "seconds": trained_seconds}


def print_result(console, result: dict, run_dir: Path, temperature: float = 1.0) -> None:
    from rich.table import Table

    before, after = result["before"], result["after"]
    table = Table(title=f"held-out accuracy (arithmetic test split), version 0 -> {result['version']}")
    for col in ("", "before", "after"):
        table.add_column(col, justify="right")
    table.add_row(f"pass@1 (T={temperature:g})", f"{100 * before['pass_at_1']:.1f}%", f"{100 * after['pass_at_1']:.1f}%")
    table.add_row("greedy", f"{100 * before['greedy_accuracy']:.1f}%", f"{100 * after['greedy_accuracy']:.1f}%")
    console.print(table)
    console.print(f"run directory: {run_dir}  (learner/steps.jsonl, learner/checkpoints, logs/, evals.json, plot {Path(result['plot']).name})")


def run_in_process_demo(config, run_path) -> None:
    """Sampler and learner in this process; staleness simulated by `config.delay`."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from swarm.local_training import run_local
    from swarm.plots import plot_run

    console = Console(stderr=True)
    console.print(f"[bold]swarm demo[/]: {config.loss.name} on the embedded policy, {config.steps} steps of "
                  f"{config.prompts_per_step} prompts x {config.group_size} completions, delay {config.delay}")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[info]}"), console=console) as bar:
        job = bar.add_task("training", total=config.steps, info="")
        state = {"eval": ""}

        def on_step(m):
            bar.update(job, advance=1, info=f"reward {m['reward_mean']:.2f}  staleness {m['staleness_mean']:.1f}  {state['eval']}")

        def on_eval(e):
            state["eval"] = f"held-out pass@1 {e['pass_at_1']:.2f} (step {e['step']})"
            bar.update(job, info=state["eval"])

        result = run_local(config, run_dir=run_path, on_step=on_step, on_eval=on_eval)
    (run_path / "evals.json").write_text(json.dumps(result["evals"], indent=2))
    plot = plot_run(result["history"], result["evals"], run_path / "training.png", f"{config.loss.name}, delay {config.delay}")
    first, last = result["evals"][0], result["evals"][-1]
    table = Table(title="held-out accuracy (arithmetic test split)")
    for col in ("", "before", "after"):
        table.add_column(col, justify="right")
    table.add_row(f"pass@1 (T={config.temperature:g})", f"{100 * first['pass_at_1']:.1f}%", f"{100 * last['pass_at_1']:.1f}%")
    table.add_row("greedy", f"{100 * first['greedy_accuracy']:.1f}%", f"{100 * last['greedy_accuracy']:.1f}%")
    Console().print(table)
    Console().print(f"run directory: {run_path}  (steps.jsonl, evals.json, config.json, plot {plot.name})")
