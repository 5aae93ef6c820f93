"""The `swarm` subcommands. Each body imports its heavy libraries late (`swarm --help` must not
import torch), and turns expected failures into a one-line message and exit status 1."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

import click

from swarm.cli_config import config_from_options, config_options

# Failures a user can fix get a clear message instead of a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, PermissionError)


@contextmanager
def user_errors():
    try:
        yield
    except USER_ERRORS as exc:
        if hasattr(exc, "errors") and callable(exc.errors):  # pydantic: one line per bad field
            lines = [
                f"{'.'.join(str(p) for p in e.get('loc', ())) or 'config'}: {e['msg'].removeprefix('Value error, ')}"
                for e in exc.errors()
            ]
            raise click.ClickException("; ".join(lines)) from exc
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


@click.command("demo")
@click.option("--steps", default=60, show_default=True, type=click.IntRange(min=1), help="learner steps")
@click.option("--loss", default="gepo", show_default=True, help="policy loss (gepo, grpo, gspo, ...)")
@click.option("--lr", default=1e-4, show_default=True, type=click.FloatRange(min=0, min_open=True))
@click.option("--prompts-per-step", default=32, show_default=True, type=click.IntRange(min=1), help="rollout groups per learner step")
@click.option("--group-size", default=8, show_default=True, type=click.IntRange(min=2))
@click.option("--samplers", default=2, show_default=True, type=click.IntRange(1, 16), help="sampler processes")
@click.option("--pickup-delay", default="none", show_default=True,
              help="samplers' simulated latency before using a new version, seconds: none | fixed:S | uniform:S | lognormal:LO,HI")
@click.option("--transport", default="hivemind", show_default=True, type=click.Choice(["hivemind", "grpc"]),
              help="how the demo's peers talk: hivemind (libp2p) or the gRPC fallback")
@click.option("--in-process", is_flag=True, help="train in this one process instead (no network; --delay simulates staleness)")
@click.option("--delay", default="none", show_default=True, help="with --in-process: none | fixed:K | uniform:K | lognormal:LO,HI,STEP_S")
@click.option("--run-dir", type=click.Path(file_okay=False), help="where logs, checkpoints and the plot go (default runs/demo-TIME)")
@click.option("--seed", default=0, show_default=True, type=int, help="with --in-process")
def demo_command(steps, loss, lr, prompts_per_step, group_size, samplers, pickup_delay, transport, in_process, delay, run_dir, seed):
    """Train the embedded policy with GEPO on a whole local swarm and show accuracy before and after.

    Starts a bootstrap node, a learner and samplers as separate processes on 127.0.0.1 (Ctrl-C
    stops them all), shows them train, then evaluates the first and the last version."""
    import time
    from pathlib import Path

    from rich.console import Console

    with user_errors():
        from swarm.losses import LossConfig
        from swarm.staleness import DelayDistribution, SecondsDelay

        LossConfig(name=loss)
        DelayDistribution.parse(delay)
        SecondsDelay.parse(pickup_delay)
    run_path = Path(run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    if run_path.exists() and any(run_path.iterdir()):
        raise click.ClickException(f"run directory {run_path} is not empty; choose another --run-dir")
    run_path.mkdir(parents=True, exist_ok=True)
    if in_process:
        from swarm.local_training import LocalRunConfig

        with user_errors():
            config = LocalRunConfig(loss=LossConfig(name=loss), steps=steps, lr=lr, prompts_per_step=prompts_per_step,
                                    group_size=group_size, delay=delay, seed=seed)
        (run_path / "config.json").write_text(config.model_dump_json(indent=2))
        from swarm.demo import run_in_process_demo

        run_in_process_demo(config, run_path)
        return
    from swarm.demo import SwarmDemoOptions, print_result, run_swarm_demo

    options = SwarmDemoOptions(steps=steps, loss=loss, lr=lr, groups_per_step=prompts_per_step, group_size=group_size,
                               samplers=samplers, pickup_delay=pickup_delay, transport=transport)
    console = Console(stderr=True)
    try:
        result = run_swarm_demo(options, run_path, console=console)
    except KeyboardInterrupt:
        raise click.ClickException(f"interrupted; all demo processes were stopped. Logs: {run_path / 'logs'}") from None
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None
    print_result(Console(), result, run_path)


@click.command("bootstrap")
@click.option("--host", default="0.0.0.0", show_default=True, help="address to listen on (0.0.0.0: all IPv4 interfaces)")
@click.option("--port", default=31337, show_default=True, type=click.IntRange(0, 65535), help="TCP port (0: any free port)")
@click.option("--identity", type=click.Path(dir_okay=False), help="libp2p key file; keeps the peer id across restarts "
              "(default: ~/.cache/gepo-swarm/identity/bootstrap.p2p.key)")
@click.option("--peers", multiple=True, help="other bootstrap nodes or peers to connect to (multiaddr; repeatable)")
@click.option("--run-id", default="swarm", show_default=True, help="the run whose members the status line counts")
@click.option("--status-every", default=60.0, show_default=True, type=click.FloatRange(min=0.1), help="seconds between status lines")
@click.option("--transport", default="hivemind", show_default=True, type=click.Choice(["hivemind", "grpc"]),
              help="grpc: act as the registry of a gRPC swarm (where libp2p cannot run)")
def bootstrap_command(host, port, identity, peers, run_id, status_every, transport):
    """Start a bootstrap node: the DHT address other peers join through."""
    from pathlib import Path

    from bootstrap.node import run_bootstrap
    from swarm.fabric.dht import JoinError
    from swarm.fabric.identity import default_identity_dir

    identity_path = Path(identity) if identity else default_identity_dir() / "bootstrap.p2p.key"
    with user_errors():
        try:
            run_bootstrap(run_id=run_id, host=host, port=port, identity_path=identity_path, initial_peers=peers,
                          status_every_s=status_every, echo=lambda line: click.echo(line, nl=True), transport=transport)
        except JoinError as exc:
            raise click.ClickException(str(exc)) from exc


@click.command("learner")
@config_options("learner")
def learner_command(config_file, **options):
    """Train the policy on rollouts from samplers and publish each new version.

    Settings come from the options below, over a config file (--config), over the defaults; the
    resolved configuration is written to the run directory as config.yaml."""
    import time
    from pathlib import Path

    from peers.learner import run_learner
    from swarm.fabric.dht import JoinError

    config = config_from_options("learner", config_file, options)
    if config.run_dir is None:
        config = config.model_copy(update={"run_dir": Path(f"runs/learner-{time.strftime('%Y%m%d-%H%M%S')}")})
    with user_errors():
        try:
            result = run_learner(config, echo=click.echo)
        except JoinError as exc:
            raise click.ClickException(str(exc)) from exc
    click.echo(f"learner stopped at version {result['version']} ({result['used']} groups used, dropped {result['dropped']}, "
               f"refused on receipt {result['refused'] or 'none'}, banned {result['banned'] or 'none'}); run directory {result['run_dir']}")


@click.command("sampler")
@config_options("sampler")
def sampler_command(config_file, **options):
    """Generate and score rollouts with the newest policy version and send them to the learner.

    Settings come from the options below, over a config file (--config), over the defaults."""
    from peers.sampler import run_sampler
    from swarm.fabric.dht import JoinError

    config = config_from_options("sampler", config_file, options)
    with user_errors():
        try:
            result = run_sampler(config, echo=click.echo)
        except (JoinError, TimeoutError) as exc:
            raise click.ClickException(str(exc)) from exc
    click.echo(f"sampler stopped: {result['sent']} groups accepted over {result['rounds']} rounds, at version "
               f"{result['version']}; refused by the learner: {result['refused'] or 'none'}")


@click.command("status")
@click.option("--peers", multiple=True, required=True, help="multiaddr of a bootstrap node or any peer (repeatable)")
@click.option("--run-id", default="swarm", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print JSON for scripts")
@click.option("--watch", default=None, type=click.FloatRange(min=1), help="refresh every this many seconds")
@click.option("--transport", default="hivemind", show_default=True, type=click.Choice(["hivemind", "grpc"]))
def status_command(peers, run_id, as_json, watch, transport):
    """Who is in the swarm: role, version, staleness, throughput and last heartbeat of each peer."""
    import time

    from swarm.fabric.dht import JoinError

    with user_errors():
        try:
            observer = _observer(transport, run_id, peers)
        except JoinError as exc:
            raise click.ClickException(str(exc)) from exc
    try:
        while True:
            now = observer.now()
            members = observer.members()
            learner_version = max((m.record.version for m in members if m.record.role == "learner"), default=None)
            rows = [{"role": m.record.role, "peer_id": m.record.peer_id, "version": m.record.version,
                     "staleness": None if learner_version is None else learner_version - m.record.version,
                     "rollouts": m.record.rollouts, "tokens_per_s": round(m.record.tokens_per_s, 1),
                     "last_heartbeat_s": round(now - m.record.time, 1), "software": m.record.software} for m in members]
            if as_json:
                click.echo(json.dumps({"run_id": run_id, "learner_version": learner_version, "peers": rows}))
            else:
                from rich.console import Console
                from rich.table import Table

                table = Table(title=f"run '{run_id}': learner version {learner_version if learner_version is not None else '-'}, "
                                    f"{len(rows)} peer(s)")
                for col in ("role", "peer", "version", "staleness", "rollouts", "tokens/s", "last heartbeat"):
                    table.add_column(col)
                for r in rows:
                    table.add_row(r["role"], r["peer_id"][-12:], str(r["version"]), str(r["staleness"]), str(r["rollouts"]),
                                  str(r["tokens_per_s"]), f"{r['last_heartbeat_s']}s ago")
                Console().print(table)
            if not watch:
                break
            time.sleep(watch)
    except KeyboardInterrupt:
        pass
    finally:
        observer.shutdown()


def _observer(transport: str, run_id: str, peers):
    """Something with members(), now() and shutdown() that reads the swarm without joining it."""
    from types import SimpleNamespace

    if transport == "grpc":
        import time

        from hivemind.utils.crypto import RSAPrivateKey

        from swarm.fabric.grpc_peer import GrpcFabric

        if len(peers) != 1 or peers[0].startswith("/"):
            raise ValueError("with --transport grpc pass exactly one --peers HOST:PORT (the registry)")
        fabric = GrpcFabric(peers[0], run_id, RSAPrivateKey(), serve=False)
        return SimpleNamespace(members=fabric.members, now=time.time, shutdown=fabric.shutdown)
    from hivemind.utils import get_dht_time

    from swarm.fabric.dht import start_dht
    from swarm.fabric.records import list_members

    dht, _ = start_dht(run_id, initial_peers=peers)
    return SimpleNamespace(members=lambda: list_members(dht, run_id), now=get_dht_time, shutdown=dht.shutdown)


def register_commands(main: click.Group) -> None:
    main.add_command(status_command)
    main.add_command(learner_command)
    main.add_command(sampler_command)
    main.add_command(bootstrap_command)
    main.add_command(eval_command)
    main.add_command(demo_command)
