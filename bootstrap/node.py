"""The bootstrap node: the entry point other peers join through (`swarm bootstrap`). Over hivemind
it is a DHT node with a stable peer id; over gRPC it is the registry of the run's records.

It holds no model and imports none; several bootstrap nodes (or any running peer) can serve as
initial peers of a hivemind swarm, so losing one does not split it. In its run directory:
ready.json (the addresses to pass to --peers) and events.jsonl (a status record every
`status_every_s`: how many learners and samplers their records say; no learner version, which only
the run's key can vouch for and this node knows none). With `dashboard_port` it
also serves the live dashboard of the swarm (swarm/dashboard/).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

from swarm.config import BootstrapConfig
from swarm.dashboard import peer_dashboard
from swarm.fabric.membership.identity import default_identity_dir
from swarm.fabric.transports import observe, start_bootstrap
from swarm.runlog import EventLog, write_ready
from swarm.signals import install_stop_signals


VERSION_HINT = ("; the learner's version is not shown here (any peer can call itself a learner): "
                "`swarm status --learner-key KEY` reads the one the run's key announced")


def run_bootstrap(config: BootstrapConfig, *, echo: Callable[[str], None] = print,
                  stop: threading.Event | None = None) -> None:
    """Run until SIGINT/SIGTERM (or `stop` is set)."""
    stop = stop or threading.Event()
    install_stop_signals(stop)
    run_dir = Path(config.run_dir or f"runs/bootstrap-{time.strftime('%Y%m%d-%H%M%S')}")
    identity = config.identity or default_identity_dir() / "bootstrap.p2p.key"
    events = EventLog(run_dir)
    try:
        node = start_bootstrap(config.transport, run_id=config.run_id, host=config.host, port=config.port,
                               identity_path=identity, initial_peers=config.peers, announce_addr=config.announce_addr,
                               insecure=config.insecure, max_runs_per_owner=config.max_runs_per_owner)
    except BaseException:
        events.close()
        raise
    observer = dashboard = None
    try:
        addresses = node.addresses()
        if config.dashboard_port is not None:
            # --dashboard-port: a bootstrap node takes no part in the swarm, so it looks at it as `swarm
            # dashboard` does, through an observer joined through its own address ranked last (loopback,
            # where it listens there: this process can always dial it)
            observer = observe(config.transport, run_id=config.run_id, peers=addresses[-1:], insecure=config.insecure)
            dashboard = peer_dashboard(config, observer, run_dir=run_dir, peers=addresses[-1:])
        write_ready(run_dir, role="bootstrap", run_id=config.run_id, transport=node.transport,
                    peer_id=node.peer_id, addresses=addresses, **({"dashboard": dashboard.url} if dashboard else {}))
        # the address to give others comes first, on a line of its own: the best guess at one
        # other machines can dial (announced, else public, else private; loopback last)
        echo(f"peers join with: --transport {node.transport} --peers {addresses[0]}")
        echo(f"bootstrap node for run '{config.run_id}' ({node.transport}), run directory {run_dir}")
        if len(addresses) > 1:
            echo("other addresses of this node (give the one the joining machine can reach):")
            for addr in addresses[1:]:
                echo(f"  --peers {addr}")
        if dashboard is not None:
            echo(f"dashboard of run '{config.run_id}' at {dashboard.url}")
        started, told_version = time.time(), False
        while not stop.wait(config.status_every_s):
            members = node.members()
            roles = {r: sum(m.record.role == r for m in members) for r in ("sampler", "learner")}
            # no learner version: this node knows no run key, and a version from the records is any
            # writer's word (a squatter calling itself a learner at 999999); the run's key tells it
            events.event("status", uptime_s=round(time.time() - started, 1), learners=roles["learner"],
                         samplers=roles["sampler"])
            echo(f"[{time.strftime('%H:%M:%S')}] up {int(time.time() - started)}s: {roles['learner']} learner(s), "
                 f"{roles['sampler']} sampler(s) by their records{'' if told_version else VERSION_HINT}")
            told_version = True
    finally:
        if dashboard is not None:
            dashboard.close()
        if observer is not None:
            observer.shutdown()
        events.close()
        node.shutdown()
