"""The bootstrap node: a DHT node with a stable peer id that other peers join through.

It holds no model and imports none; several bootstrap nodes (or any running peer) can serve as
initial peers, so losing one does not split the swarm.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

logger = logging.getLogger(__name__)


def listen_maddrs(host: str, port: int) -> list[str]:
    """TCP multiaddrs to listen on: an IPv4 or IPv6 literal host, port 0 meaning any free port."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be 0..65535, got {port}")
    family = "ip6" if ":" in host else "ip4"
    return [f"/{family}/{host}/tcp/{port}"]


def run_bootstrap(
    *,
    run_id: str,
    host: str = "0.0.0.0",
    port: int = 31337,
    identity_path: Path,
    initial_peers: Sequence[str] = (),
    status_every_s: float = 60.0,
    echo: Callable[[str], None] = print,
    stop: threading.Event | None = None,
    transport: str = "hivemind",
) -> None:
    """Run until SIGINT/SIGTERM (or `stop` is set). Prints the peer's multiaddrs first."""
    from swarm.fabric.dht import start_dht
    from swarm.fabric.records import list_members

    from peers.common import install_stop_signals

    stop = stop or threading.Event()
    install_stop_signals(stop)
    if transport == "grpc":
        return _run_registry(run_id=run_id, host=host, port=port, status_every_s=status_every_s, echo=echo, stop=stop)
    dht, _ = start_dht(run_id, initial_peers=initial_peers, host_maddrs=listen_maddrs(host, port), identity_path=identity_path)
    try:
        echo(f"bootstrap node for run '{run_id}', peer id {dht.peer_id}")
        echo("peers join with:")
        for maddr in dht.get_visible_maddrs():
            echo(f"  --peers {maddr}")
        started = time.time()
        while not stop.wait(status_every_s):
            members = list_members(dht, run_id)
            roles = {r: sum(m.record.role == r for m in members) for r in ("sampler", "learner")}
            versions = [m.record.version for m in members if m.record.role == "learner"]
            echo(f"[{time.strftime('%H:%M:%S')}] up {int(time.time() - started)}s: {roles['learner']} learner(s), "
                 f"{roles['sampler']} sampler(s), learner version {max(versions) if versions else '-'}")
    finally:
        dht.shutdown()


def _run_registry(*, run_id: str, host: str, port: int, status_every_s: float, echo, stop: threading.Event) -> None:
    """The gRPC fallback: this node is the registry of membership records and version announcements."""
    from swarm.fabric.grpc_transport import Registry, serve_registry

    registry = Registry()
    server, bound = serve_registry(registry, host, port)
    try:
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        echo(f"bootstrap registry (gRPC) for run '{run_id}' on {host}:{bound}")
        echo("peers join with (use this machine's address from elsewhere):")
        echo(f"  --transport grpc --peers {shown}:{bound}")
        started = time.time()
        while not stop.wait(status_every_s):
            roles = registry.counts(run_id)
            echo(f"[{time.strftime('%H:%M:%S')}] up {int(time.time() - started)}s: {roles['learner']} learner(s), "
                 f"{roles['sampler']} sampler(s)")
    finally:
        server.stop(grace=1.0).wait(5)
