"""The `swarm` subcommands. Each body imports its heavy libraries late (`swarm --help` must not
import torch), and turns expected failures into a one-line message and exit status 1."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

import click

# Failures a user can fix get a clear message instead of a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, PermissionError)


@contextmanager
def user_errors():
    try:
        yield
    except USER_ERRORS as exc:
        raise click.ClickException(str(exc)) from exc


@click.command("eval")
@click.option("--model", default="embedded", show_default=True, help="model directory, hub id, or 'embedded'")
@click.option("--task", "task_name", default="arithmetic", show_default=True, help="'arithmetic', a local jsonl/json/parquet/csv file, or a dataset id")
@click.option("--split", default="test", show_default=True, type=click.Choice(["train", "test"]))
@click.option("--limit", default=200, show_default=True, type=click.IntRange(min=1), help="problems to evaluate")
@click.option("-k", "--samples", default=4, show_default=True, type=click.IntRange(min=1), help="samples per problem for pass@1")
@click.option("--temperature", default=1.0, show_default=True, type=click.FloatRange(min=0, min_open=True))
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--no-greedy", is_flag=True, help="skip the temperature-0 accuracy")
@click.option("--difficulty", default=2, show_default=True, type=click.IntRange(1, 4), help="arithmetic task difficulty")
@click.option("--question-column", default="question", show_default=True)
@click.option("--answer-column", default="answer", show_default=True)
@click.option("--backend", default="transformers", show_default=True, type=click.Choice(["transformers", "vllm"]))
@click.option("--device", default="cpu", show_default=True, help="torch device for the transformers backend")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON")
def eval_command(model, task_name, split, limit, samples, temperature, max_new_tokens, no_greedy, difficulty,
                 question_column, answer_column, backend, device, seed, as_json):
    """Accuracy of a policy on a task: pass@1 over k samples, and greedy accuracy."""
    from swarm.evaluation import evaluate

    options = {"difficulty": difficulty} if task_name == "arithmetic" else {
        "question_column": question_column, "answer_column": answer_column}
    with user_errors():
        result = evaluate(
            model, task_name, split=split, limit=limit, samples=samples, temperature=temperature,
            max_new_tokens=max_new_tokens, greedy=not no_greedy, backend_name=backend, device=device,
            seed=seed, show_progress=not as_json and sys.stderr.isatty(), task_options=options,
        )
    if as_json:
        click.echo(json.dumps(result.as_dict(), indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{result.model} on {result.task} ({result.split}, {result.num_problems} problems)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row(f"pass@1 (k={result.samples_per_problem}, T={result.temperature:g})", f"{100 * result.pass_at_1:.1f}%")
    if result.greedy_accuracy is not None:
        table.add_row("greedy accuracy", f"{100 * result.greedy_accuracy:.1f}%")
    table.add_row("unscorable completions", str(result.unscorable))
    table.add_row("completion tokens", str(result.completion_tokens))
    table.add_row("seconds", f"{result.seconds:.1f}")
    Console().print(table)


def register_commands(main: click.Group) -> None:
    main.add_command(eval_command)
