"""The commands that run a peer or look at a swarm: `swarm bootstrap`, `learner`, `sampler` and
`status`. Each body imports its heavy libraries late (`swarm --help` must not import torch)."""

from __future__ import annotations

import json
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import click

from swarm.cli.consoles import stdout_console
from swarm.cli.options import GroupedCommand, GroupedOption, config_from_options, config_options, user_errors
from swarm.config import TRANSPORTS, BootstrapConfig, LearnerConfig, SamplerConfig, SwarmSettings, default_of
from swarm.dashboard.live import status_rows as rows_of
from swarm.health import status_flags, swarm_args
from swarm.model.paths import check_local_model
from swarm.ports import check_config_ports
from swarm.progress import progress_for
from swarm.signals import install_stop_signals
from swarm.tasks import check_task_name


def _join_failures() -> tuple[type[BaseException], ...]:
    """What makes a peer fail while starting or running, reported in one line (exit status 1): the
    swarm cannot be reached, a port is taken, an optional extra is missing."""
    from swarm.fabric.interface import JoinError  # torch (through swarm.rollouts): not at `swarm --help`

    return (JoinError, TimeoutError, OSError, ImportError)


def _progress():
    """A peer's progress of long steps (checkpoints, downloads): a bar on a terminal, else lines
    among its output."""
    return progress_for(sys.stdout, echo=click.echo)


@click.command("bootstrap", cls=GroupedCommand)
@config_options(BootstrapConfig)
def bootstrap_command(config_file, **options):
    """Start a bootstrap node: the address other peers join through.

    Writes RUN_DIR/ready.json (its addresses) and a status record to RUN_DIR/events.jsonl every
    --status-every-s seconds."""
    config = config_from_options("bootstrap", config_file, options)
    with user_errors(OSError):
        check_config_ports(config)  # at once, naming the option: not after a join timeout, nor beside another node
    from bootstrap.node import run_bootstrap  # torch (through swarm.fabric.transports): not at `swarm --help`
    with user_errors(*_join_failures()):
        run_bootstrap(config, echo=click.echo)


@click.command("learner", cls=GroupedCommand)
@config_options(LearnerConfig)
def learner_command(config_file, **options):
    """Train the policy on rollouts from samplers and publish each new version.

    Settings come from the options below, over a config file (--config), over the defaults; the
    resolved configuration is written to the run directory as config.yaml, beside ready.json
    (peer id, addresses, learner key), steps.jsonl and events.jsonl."""
    config = config_from_options("learner", config_file, options)
    with user_errors(OSError):
        check_config_ports(config)  # at once, naming the option: not after a join timeout, nor beside another node
        check_task_name(config.task)  # and an unknown task or a missing file, before torch is imported
        check_local_model(config.model)  # and a local --model that does not exist
    from peers.learner import run_learner  # torch: not at `swarm --help`
    if config.run_dir is None:
        config = config.model_copy(update={"run_dir": Path(f"runs/learner-{time.strftime('%Y%m%d-%H%M%S')}")})
    with user_errors(*_join_failures()):
        result = run_learner(config, echo=click.echo, progress=_progress())
    click.echo(f"learner stopped at version {result['version']} ({result['used']} groups used, dropped {result['dropped']}, "
               f"refused on receipt {result['refused'] or 'none'}, banned {result['banned'] or 'none'}); run directory {result['run_dir']}")


@click.command("sampler", cls=GroupedCommand)
@config_options(SamplerConfig)
def sampler_command(config_file, **options):
    """Generate and score rollouts with the newest policy version and send them to the learner.

    Settings come from the options below, over a config file (--config), over the defaults; the
    run directory gets config.yaml, ready.json and events.jsonl (versions fetched, groups sent
    and refused, throughput)."""
    config = config_from_options("sampler", config_file, options)
    with user_errors(OSError):
        check_config_ports(config)  # at once, naming the option: not after a join timeout, nor beside another node
        check_task_name(config.task)  # and an unknown task or a missing file, before torch is imported
        check_local_model(config.model)  # and a local --model that does not exist
    from peers.sampler import run_sampler  # torch: not at `swarm --help`
    with user_errors(*_join_failures()):
        result = run_sampler(config, echo=click.echo, progress=_progress())
    ended = "" if result["run_ended_at"] is None else f"the run ended at version {result['run_ended_at']}; "
    click.echo(f"sampler stopped: {ended}{result['sent']} groups accepted over {result['rounds']} rounds, at version "
               f"{result['version']}; refused by the learner: {result['refused'] or 'none'}; run directory {result['run_dir']}")


def swarm_option(name: str, **kwargs):
    """An option spelled, described and defaulted as in learner and sampler (from SwarmSettings)."""
    default = default_of(SwarmSettings, name)
    return click.option(f"--{name.replace('_', '-')}", name, help=SwarmSettings.model_fields[name].description,
                        default=default if default != [] else None, cls=GroupedOption, group="swarm", show_default=True,
                        **kwargs)


@click.command("status", cls=GroupedCommand)
@swarm_option("peers", multiple=True, required=True)
@swarm_option("run_id")
@swarm_option("transport", type=click.Choice(TRANSPORTS))
@swarm_option("insecure", is_flag=True)
@click.option("--learner-key", "learner_keys", multiple=True, cls=GroupedOption, group="swarm",
              help="the run's key, as the learner prints it (repeatable): the learner version shown is the newest "
                   "one announced under it (or by a learner it certified); unset: no learner version is shown")
@click.option("--learner-key-file", type=click.Path(dir_okay=False, path_type=Path), default=None, cls=GroupedOption,
              group="swarm", help="a file holding the run's key (the learner writes RUN_DIR/learner.key)")
@click.option("--json", "as_json", is_flag=True, cls=GroupedOption, group="output", help="print JSON for scripts")
@click.option("--watch", default=None, type=click.FloatRange(min=1), cls=GroupedOption, group="output",
              help="refresh every this many seconds")
def status_command(peers, run_id, transport, insecure, learner_keys, learner_key_file, as_json, watch):
    """Who is in the swarm: role, version, staleness, throughput and last heartbeat of each peer; then
    what looks wrong (late heartbeats, refused rollouts, a stalled learner, versions no sampler has
    picked up), each with the command that shows more. The learner version is read only from
    announcements signed by the run's key (--learner-key): any peer can call itself a learner."""
    with user_errors():
        keys = _run_keys(learner_keys, learner_key_file)
    # a Ctrl-C sets an event that the watch checks between rounds: raised as KeyboardInterrupt inside
    # a round's DHT reads it could be swallowed there, and the watch went on (seen at load)
    stop = threading.Event()
    if watch:
        install_stop_signals(stop)
    with observe_swarm(transport, run_id, peers, insecure=insecure) as observer:
        while True:
            now, members = observer.now(), _members_and_learners(observer, keys)
            announced = _announced(observer, keys)
            learner_version = None if announced is None else announced.version
            adapter = _adapter(announced)
            _, rows = status_rows(now, members, learner_version)
            flags = status_flags(now, members, learner_version, args=swarm_args(peers, run_id, transport))
            if as_json:
                click.echo(json.dumps({"run_id": run_id, "learner_version": learner_version, "adapter": adapter,
                                       "peers": rows, "flags": flags}))
            else:
                _print_status(run_id, learner_version, rows, adapter)
                if not keys:
                    click.echo("(no learner version: pass --learner-key, or --learner-key-file RUN_DIR/learner.key, "
                               "to read the version the run's learner announced)")
                _print_flags(flags)
            if not watch or stop.wait(watch):  # Ctrl-C ends the watch between two rounds (exit 130)
                break


def _run_keys(learner_keys, learner_key_file) -> list[bytes]:
    """The run's keys from --learner-key and --learner-key-file, checked."""
    from swarm.config.learner_keys import decode_learner_key

    texts = list(learner_keys)
    if learner_key_file is not None:
        try:
            texts.append(Path(learner_key_file).read_text().strip())
        except OSError as exc:
            raise click.UsageError(f"--learner-key-file {learner_key_file}: {exc.strerror}") from None
    return list(dict.fromkeys(decode_learner_key(t.strip()) for t in texts))


def _members_and_learners(observer, keys: list[bytes]) -> list:
    """The listed members, and the run's authorised learners found from its keys (over hivemind: a
    flood of records in the open pages cannot hide them) where the pages left them out."""
    members = observer.members()
    find = getattr(observer, "authorised_learners", None)
    if keys and find is not None:
        listed = {m.owner for m in members}
        try:
            members += [m for m in find(keys) if m.owner not in listed]
        except (*observer.unreachable_errors(), TimeoutError):
            pass
    return members


def _announced(observer, keys: list[bytes]):
    """The newest announcement under the run's keys `keys` or by a learner they certified (None: no
    keys, none announced, or the lookup failed: the flags then go by the learners' records)."""
    try:
        return observer.latest_announced(keys) if keys else None
    except (*observer.unreachable_errors(), TimeoutError):
        return None


def _adapter(announced) -> dict | None:
    """A LoRA run's adapter as its announcement names it (None: full fine-tuning, or nothing announced)."""
    sampling = announced.sampling if announced is not None else None
    if sampling is None or not sampling.lora_r:
        return None
    return {"lora_r": sampling.lora_r, "lora_alpha": sampling.lora_alpha, "target_modules": list(sampling.lora_targets),
            "base_hash": sampling.base_hash}


def _print_flags(flags: list[dict]) -> None:
    console = stdout_console()
    if not flags:
        console.print("nothing looks wrong")
    for flag in flags:  # the messages quote peers' own records: printed as text, never as markup
        console.print(f"! {flag['message']}", markup=False, highlight=False)
        console.print(f"    more: {flag['command']}", markup=False, highlight=False, soft_wrap=True)  # whole, to copy


@contextmanager
def observe_swarm(transport: str, run_id: str, peers, *, insecure: bool = False) -> Iterator:
    """An observer of the swarm (`swarm.fabric.transports.observe`: it reads records and announcements
    and takes no part), shut down on exit; a swarm that cannot be reached is a one-line error.
    `swarm status` and `swarm dashboard` look at the swarm through this."""
    from swarm.fabric.membership.addresses import check_reachable

    with user_errors(ConnectionRefusedError):  # a --peers where nothing listens: said before torch is imported
        check_reachable(transport, list(peers))
    from swarm.fabric.transports import observe  # torch (through swarm.fabric.interface): not at `swarm --help`

    with user_errors(*_join_failures()):
        observer = observe(transport, run_id=run_id, peers=list(peers), insecure=insecure)
    try:
        yield observer
    finally:
        observer.shutdown()


def status_rows(now: float, members: list, learner_version: int | None) -> tuple[int | None, list[dict]]:
    """The learner's version and one row per member, as `swarm status --json` prints them: the
    library's `swarm.dashboard.live.status_rows` (a peer's own dashboard shows the same rows),
    staleness counted from the announced `learner_version`."""
    return rows_of(now, members, learner_version)


def _print_status(run_id: str, learner_version, rows: list[dict], adapter: dict | None = None) -> None:
    from rich.markup import escape
    from rich.table import Table

    kind = f"LoRA r={adapter['lora_r']} on base {adapter['base_hash'][:12]}, " if adapter else ""
    table = Table(title=f"run '{run_id}': {kind}learner version {learner_version if learner_version is not None else '-'}, "
                        f"{len(rows)} peer(s)")
    for col in ("role", "peer", "version", "staleness", "rollouts", "tokens/s", "last heartbeat", "last fetch"):
        table.add_column(col)
    for r in rows:
        fetch = r["last_fetch"]
        # peers write their own records: nothing in them is rich markup
        table.add_row(r["role"], escape(r["peer_id"][-12:]), str(r["version"]), str(r["staleness"]), str(r["rollouts"]),
                      str(r["tokens_per_s"]), f"{r['last_heartbeat_s']}s ago",
                      "-" if fetch is None else f"v{fetch['version']} from {escape(fetch['source'][-12:])}: "
                                                f"{fetch['bytes'] / 1e6:.2f} MB in {fetch['seconds']:.2f}s")
    stdout_console().print(table)
