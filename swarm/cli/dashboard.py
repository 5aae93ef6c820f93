"""`swarm dashboard`: the live, read-only web view of a swarm (swarm/dashboard/). It looks at the
swarm as `swarm status` does (an observer: it heartbeats nothing, serves nothing, needs no secret)
and, given run directories on this machine, reads the learner's steps.jsonl and the samplers'
events.jsonl too."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import click

from swarm.cli.options import GroupedCommand, GroupedOption, user_errors
from swarm.cli.peer_commands import observe_swarm, status_rows, swarm_option
from swarm.config import TRANSPORTS


@click.command("dashboard", cls=GroupedCommand)
@swarm_option("peers", multiple=True, required=True)
@swarm_option("run_id")
@swarm_option("transport", type=click.Choice(TRANSPORTS))
@click.option("--learner-key", "learner_keys", multiple=True, cls=GroupedOption, group="swarm",
              help="count only this learner's version announcements (repeatable; the key a learner prints, or its "
                   "RUN_DIR/learner.key when --run-dir names it); unset: those of every peer whose record says learner")
@click.option("--run-dir", "--learner-run-dir", "run_dirs", multiple=True, cls=GroupedOption, group="output",
              type=click.Path(file_okay=False, path_type=Path),
              help="a peer's run directory on this machine, or a directory of them (a demo's runs/demo-*): the "
                   "learner's curves come from its steps.jsonl, the samplers' fetch and lag history from their "
                   "events.jsonl (repeatable)")
@click.option("--host", default="127.0.0.1", show_default=True, cls=GroupedOption, group="output",
              help="address to serve the page on (the default, loopback, keeps it to this machine: reach it from "
                   "elsewhere through an SSH tunnel)")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535), cls=GroupedOption,
              group="output", help="port to serve the page on (0: a free one)")
@click.option("--poll-s", default=1.5, show_default=True, type=click.FloatRange(min=0.2), cls=GroupedOption,
              group="output", help="seconds between readings of the swarm")
def dashboard_command(peers, run_id, transport, learner_keys, run_dirs, host, port, poll_s):
    """Serve a live web page of the swarm: peers, the learner's curves, each sampler's lag over time,
    and how fast each version reached each sampler. Read-only; Ctrl-C stops it."""
    from swarm.dashboard import DashboardServer, Poller, SwarmView
    from swarm.dashboard.runs import RunDirs
    from swarm.fabric.identity import decode_learner_key
    from swarm.signals import install_stop_signals

    with user_errors(ValueError):  # a bad --learner-key is a usage error
        keys = [decode_learner_key(k) for k in (*learner_keys, *_learner_key_files(run_dirs))]
    stop = threading.Event()
    install_stop_signals(stop)
    with observe_swarm(transport, run_id, peers) as observer:
        view = SwarmView(run_id=run_id, transport=transport, peers=list(peers), poll_s=poll_s,
                         announcements_from="the learner key(s) given" if keys else
                         "every peer whose record says learner (unverified: pass --learner-key)")
        with user_errors(OSError):  # the port is taken, the address is not this machine's
            server = DashboardServer(view, host=host, port=port)
        poller = Poller(view, lambda: read_swarm(observer, keys), run_dirs=RunDirs(list(run_dirs)) if run_dirs else None,
                        interval_s=poll_s, failures=(*observer.unreachable_errors(), TimeoutError))
        for missing in (d for d in run_dirs if not d.is_dir()):
            click.echo(f"{missing} does not exist yet: it is read once it does", err=True)
        click.echo(f"dashboard of run '{run_id}' at {server.url} (Ctrl-C stops it)")
        try:
            while not stop.wait(0.5):  # woken by SIGINT/SIGTERM (install_stop_signals)
                pass
        finally:
            poller.close()
            server.close()


def read_swarm(observer, learner_keys: list[bytes]):
    """One look at the swarm through `observer`: every member's row (as `swarm status` shows it, plus
    the model and whether others can dial it) and the newest announcement under `learner_keys`
    (none given: under the key of any peer whose record says learner)."""
    from swarm.dashboard import Reading, announcement_fields

    now = observer.now()
    members = observer.members()
    _, rows = status_rows(now, members)
    for row, member in zip(rows, members):
        row.update(model=member.record.model, relay=member.record.relay)
    keys = learner_keys or [m.owner for m in members if m.record.role == "learner"]
    announced = observer.latest_announced(keys) if keys else None
    return Reading(time=time.time(), swarm_time=now, peers=rows, announcement=announcement_fields(announced))


def _learner_key_files(run_dirs) -> list[str]:
    """The learner.key of each run directory given (or of its subdirectories) that has one."""
    found = []
    for root in (d for d in run_dirs if d.is_dir()):
        for path in (Path(root) / "learner.key", *Path(root).glob("*/learner.key")):
            if path.is_file():
                found.append(path.read_text().strip())
    return found
