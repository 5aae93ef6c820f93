"""The commands that run on this machine alone: `swarm eval` and `swarm demo`. Each body imports
its heavy libraries late (`swarm --help` must not import torch)."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import click

from swarm.cli.demo import print_result, run_in_process_demo, run_swarm_demo
from swarm.cli.consoles import stdout_console
from swarm.cli.options import GroupedCommand, GroupedOption, config_from_options, config_options, user_errors
from swarm.cli.plots import plot_steps
from swarm.config import DemoConfig, EvalConfig
from swarm.model.paths import check_local_model
from swarm.progress import progress_for
from swarm.runlog import STEPS_FILE, read_jsonl
from swarm.signals import note_signal
from swarm.tasks import check_task_name


@click.command("eval", cls=GroupedCommand)
@config_options(EvalConfig)
@click.option("--json", "as_json", is_flag=True, cls=GroupedOption, group="output", help="print the result as JSON")
def eval_command(config_file, as_json, **options):
    """Accuracy of a policy on a task: pass@1 over --eval-samples samples per problem, pass@k, and greedy accuracy.

    Reads a dataset's own test split, every row of a single file, or the arithmetic test split
    (--split chooses), and says which problems before it starts."""
    # Ctrl-C ends it with status 130 even when it started with SIGINT ignored (`&` in a script, nohup):
    # Python then leaves SIGINT ignored, and the suite's Ctrl-C test, run that way, saw eval score on
    # to the end and exit 0
    _interrupt_on(signal.SIGINT)
    config = config_from_options("eval", config_file, options)
    with user_errors(OSError):
        check_task_name(config.task)  # (light: no torch)
        check_local_model(config.model)
    # torch and transformers (seconds): imported once the options and the task are good, not at `swarm --help`
    from swarm.evaluation import evaluate

    if config.lora_r:
        with user_errors():
            check_lora_checkpoint(config.model, config.lora_r)
    with user_errors(OSError, ImportError):  # an unreadable file, a missing optional extra (--backend vllm)
        result = evaluate(
            config.model, config.task, split=config.split, limit=config.eval_problems, samples=config.eval_samples,
            temperature=config.temperature, max_completion_length=config.max_completion_length, greedy=config.greedy,
            backend_name=config.backend, device=config.device, dtype=config.dtype, seed=config.seed,
            # a bar on a terminal, plain lines in a log; on stderr: --json keeps stdout to the result
            progress=progress_for(sys.stderr, echo=lambda line: click.echo(line, err=True)), task_options=config.task_options(),
            echo=lambda line: click.echo(line, err=True),  # stderr: --json keeps stdout to the result
            ks=sorted(set(config.pass_at_k)), show=config.show,
        )
    if as_json:
        click.echo(json.dumps(result.as_dict(), indent=2))
        return
    from rich.table import Table

    table = Table(title=f"{result.model} on {result.task} ({result.split})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("problems", f"{result.num_problems} of {result.problems_in_split}")
    table.add_row(f"pass@1 (n={result.samples_per_problem}, T={result.temperature:g})", f"{100 * result.pass_at_1:.1f}%")
    for k, value in result.pass_at_k.items():
        table.add_row(f"pass@{k} (of n={result.samples_per_problem})", f"{100 * value:.1f}%")
    if result.greedy_accuracy is not None:
        table.add_row("greedy accuracy", f"{100 * result.greedy_accuracy:.1f}%")
    table.add_row("unscorable completions", str(result.unscorable))
    table.add_row("completion tokens", str(result.completion_tokens))
    table.add_row("seconds", f"{result.seconds:.1f}")
    console = stdout_console()
    for i, shown in enumerate(result.shown, start=1):  # model text: printed as text, never as rich markup
        reward = "unscorable" if shown["reward"] is None else f"{shown['reward']:g}"
        console.print(f"--- completion {i} of {len(result.shown)}: {shown['problem_id']}, gold answer "
                      f"{shown['answer']!r}, reward {reward}", markup=False, highlight=False)
        console.print(shown["prompt"] + shown["completion"], markup=False, highlight=False)
    console.print(table)


def check_lora_checkpoint(model: str, r: int) -> None:
    """`swarm eval --lora-r r`: `model` must be a LoRA run's checkpoint of rank r. A fresh adapter
    starts with B at zero, so evaluating one is evaluating its base: a ValueError saying what to
    pass instead (the newest checkpoint, when `model` is a learner's run directory)."""
    from swarm.checkpoint import latest_checkpoint
    from swarm.lora import adapter_rank, is_adapter_dir

    path = Path(model).expanduser()
    if is_adapter_dir(path):
        if adapter_rank(path) != r:
            raise ValueError(f"--lora-r {r}: {model} is the checkpoint of a LoRA run of rank {adapter_rank(path)}; pass "
                             f"--lora-r {adapter_rank(path)}, or leave --lora-r out (a checkpoint says its own rank)")
        return
    newest = latest_checkpoint(path) if path.is_dir() else None
    instead = (f"{model} is a learner's run directory: pass its newest checkpoint, --model {newest.path}" if newest else
               "pass --model RUN_DIR/checkpoints/version-N, a LoRA learner's checkpoint (its adapter_config.json names "
               "its base model and rank)")
    raise ValueError(f"--lora-r {r}: --model {model} is no LoRA checkpoint, and a fresh rank-{r} adapter is the base "
                     f"model itself (its B starts at zero): {instead}; or leave --lora-r out to evaluate {model} as it is")


@click.command("demo", cls=GroupedCommand)
@config_options(DemoConfig)
def demo_command(config_file, **options):
    """Train a policy (the embedded one, with TOPR, by default) on a whole local swarm; accuracy before and after.

    Starts a bootstrap node, a learner and samplers as separate processes on 127.0.0.1, shows them
    train, then evaluates the first and the last version. Ctrl-C stops them all, evaluates what the
    learner trained so far and exits 130 (a second Ctrl-C skips the evaluation). With --in-process,
    trains in this one process instead."""
    from rich.console import Console

    config = config_from_options("demo", config_file, options)
    run_dir = Path(config.run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    if run_dir.exists() and any(run_dir.iterdir()):
        raise click.UsageError(f"run directory {run_dir} is not empty; choose another --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    if config.in_process:
        with user_errors():
            result = run_in_process_demo(config, run_dir)
        files = "config.yaml, steps.jsonl, evals.json, plot training.png"
    else:
        _interrupt_on(signal.SIGINT, signal.SIGTERM)
        try:
            with user_errors(RuntimeError):
                result = run_swarm_demo(config, run_dir, console=Console(stderr=True))
        except KeyboardInterrupt:
            click.echo(f"all demo processes were stopped; logs in {run_dir / 'logs'}", err=True)
            raise
        files = "swarm.yaml, learner/steps.jsonl, learner/checkpoints, sampler-*/events.jsonl, logs/, evals.json, plot training.png"
    print_result(stdout_console(), config, result["before"], result["after"], result["version"], run_dir, files)
    if result.get("interrupted"):
        raise KeyboardInterrupt  # evaluated after a Ctrl-C: still a Ctrl-C's exit (130)


def _interrupt_on(*signals: int) -> None:
    """These signals interrupt the command as Ctrl-C does (the demo then stops its peers, which run
    in their own sessions: SIGTERM would end the demo without stopping them). Python leaves SIGINT
    ignored when it starts ignored (a job started with `&` by a non-interactive shell, nohup)."""

    def interrupt(signum, frame):
        note_signal(signum)  # which one: only a Ctrl-C evaluates what the swarm trained
        raise KeyboardInterrupt

    for sig in signals:
        signal.signal(sig, interrupt)


@click.command("plot")
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path),
              help="the PNG to write (default: RUN_DIR/curves.png)")
def plot_command(run_dir: Path, output: Path | None):
    """Draw a run's curves from its steps.jsonl: a learner's or the in-process trainer's run directory,
    or a demo's (its learner/ subdirectory)."""
    found = next((d for d in (run_dir, run_dir / "learner") if (d / STEPS_FILE).is_file()), None)
    if found is None:
        raise click.UsageError(f"{run_dir} holds no {STEPS_FILE} (nor learner/{STEPS_FILE}): pass the run directory of a "
                               "learner, an in-process trainer or a demo")
    records = [r for r in read_jsonl(found / STEPS_FILE) if "step" in r]
    if not records:
        raise click.ClickException(f"{found / STEPS_FILE} holds no steps yet")
    try:
        evals = json.loads((run_dir / "evals.json").read_text())
    except (OSError, ValueError):
        evals = None
    path = plot_steps(records, output or run_dir / "curves.png", title=str(run_dir), evals=evals)
    click.echo(f"{len(records)} steps -> {path}")
