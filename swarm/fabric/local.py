"""Peers of one swarm inside this process, on loopback, over either transport: for tests and
benchmarks. A real bootstrap node (DHT node or registry) starts first; each peer is a real fabric
(its own DHT node and p2p daemon, or its own gRPC server) that joins through it, with fresh keys."""

from __future__ import annotations

from swarm.config import TRANSPORTS
from swarm.fabric.transports import join, start_bootstrap


class LocalFabrics:
    def __init__(self, transport: str, run_id: str) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {transport!r}; use one of {', '.join(TRANSPORTS)}")
        self.transport, self.run_id = transport, run_id
        self.made: list = []
        self.bootstrap = start_bootstrap(transport, run_id=run_id, host="127.0.0.1", port=0)

    def make(self, heartbeat_s: float = 1.0):
        """A new peer that joined through the bootstrap node."""
        fabric = join(self.transport, run_id=self.run_id, peers=self.bootstrap.addresses(), role="peer",
                      heartbeat_s=heartbeat_s)
        self.made.append(fabric)
        return fabric

    def close(self) -> None:
        for fabric in self.made:
            try:
                fabric.shutdown()
            except Exception:  # noqa: BLE001  it may have been shut down already
                pass
        self.made.clear()
        if self.bootstrap is not None:
            self.bootstrap.shutdown()
            self.bootstrap = None

    def __enter__(self) -> "LocalFabrics":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
