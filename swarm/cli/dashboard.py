"""`swarm dashboard`: the live, read-only web view of a swarm (swarm/dashboard/). It looks at the
swarm as `swarm status` does (an observer: it heartbeats nothing, serves nothing, needs no secret)
and, given run directories on this machine, reads the learner's steps.jsonl and the samplers'
events.jsonl too."""

from __future__ import annotations

import threading
from pathlib import Path

import click

from swarm.cli.options import GroupedCommand, GroupedOption, user_errors
from swarm.cli.peer_commands import observe_swarm, swarm_option
from swarm.config import TRANSPORTS, default_of
from swarm.config.learner_keys import decode_learner_key
from swarm.config.settings import DashboardSettings
from swarm.dashboard import LiveDashboard
from swarm.ports import check_port_free
from swarm.signals import install_stop_signals


@click.command("dashboard", cls=GroupedCommand)
@swarm_option("peers", multiple=True, required=True)
@swarm_option("run_id")
@swarm_option("transport", type=click.Choice(TRANSPORTS))
@swarm_option("insecure", is_flag=True)
@click.option("--learner-key", "learner_keys", multiple=True, cls=GroupedOption, group="swarm",
              help="count only this learner's version announcements (repeatable; the key a learner prints, or its "
                   "RUN_DIR/learner.key when --run-dir names it); unset: those of every peer whose record says learner")
@click.option("--run-dir", "--learner-run-dir", "run_dirs", multiple=True, cls=GroupedOption, group="output",
              type=click.Path(file_okay=False, path_type=Path),
              help="a peer's run directory on this machine, or a directory of them (a demo's runs/demo-*): the "
                   "learner's curves come from its steps.jsonl, the samplers' fetch and lag history from their "
                   "events.jsonl (repeatable)")
@click.option("--host", default=default_of(DashboardSettings, "dashboard_host"), show_default=True, cls=GroupedOption,
              group="output", help="address to serve the page on (the default, loopback, keeps it to this machine: "
                                   "reach it from elsewhere through an SSH tunnel)")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535), cls=GroupedOption,
              group="output", help="port to serve the page on (0: a free one)")
@click.option("--poll-s", default=default_of(DashboardSettings, "dashboard_poll_s"), show_default=True,
              type=click.FloatRange(min=0.2), cls=GroupedOption, group="output", help="seconds between readings of the swarm")
def dashboard_command(peers, run_id, transport, insecure, learner_keys, run_dirs, host, port, poll_s):
    """Serve a live web page of the swarm: peers, the learner's curves, each sampler's lag over time,
    and how fast each version reached each sampler. Read-only; Ctrl-C stops it."""
    with user_errors(ValueError):  # a bad --learner-key is a usage error
        keys = [decode_learner_key(k) for k in (*learner_keys, *_learner_key_files(run_dirs))]
    with user_errors(OSError):
        check_port_free(host, port, "--port")  # at once, before joining the swarm to observe it
    stop = threading.Event()
    install_stop_signals(stop)
    with observe_swarm(transport, run_id, peers, insecure=insecure) as observer:
        with user_errors(OSError):  # the port is taken, the address is not this machine's
            dashboard = LiveDashboard(observer, run_id=run_id, transport=transport, peers=peers, host=host, port=port,
                                      learner_keys=keys, run_dirs=list(run_dirs), poll_s=poll_s)
        for missing in (d for d in run_dirs if not d.is_dir()):
            click.echo(f"{missing} does not exist yet: it is read once it does", err=True)
        click.echo(f"dashboard of run '{run_id}' at {dashboard.url} (Ctrl-C stops it)")
        try:
            while not stop.wait(0.5):  # woken by SIGINT/SIGTERM (install_stop_signals)
                pass
        finally:
            dashboard.close()


def _learner_key_files(run_dirs) -> list[str]:
    """The learner.key of each run directory given (or of its subdirectories) that has one."""
    found = []
    for root in (d for d in run_dirs if d.is_dir()):
        for path in (Path(root) / "learner.key", *Path(root).glob("*/learner.key")):
            if path.is_file():
                found.append(path.read_text().strip())
    return found
