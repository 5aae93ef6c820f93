"""Peers of one swarm inside this process, on loopback, over either transport: for tests and
benchmarks. Each peer is a real fabric (its own DHT node and p2p daemon, or its own gRPC server
reaching one registry server)."""

from __future__ import annotations


class LocalFabrics:
    def __init__(self, transport: str, run_id: str) -> None:
        if transport not in ("hivemind", "grpc"):
            raise ValueError(f"unknown transport {transport!r}; use hivemind or grpc")
        self.transport, self.run_id = transport, run_id
        self.made: list = []
        self._registry_server = None
        if transport == "grpc":
            from swarm.fabric.grpc_transport import Registry, serve_registry

            self._registry_server, port = serve_registry(Registry())
            self.registry = f"127.0.0.1:{port}"

    def make(self, heartbeat_s: float = 1.0):
        """A new peer; over hivemind, each later one joins through the first one's DHT node."""
        if self.transport == "grpc":
            from hivemind.utils.crypto import RSAPrivateKey

            from swarm.fabric.grpc_peer import GrpcFabric

            fabric = GrpcFabric(self.registry, self.run_id, RSAPrivateKey(), heartbeat_s=heartbeat_s)
        else:
            from swarm.fabric.dht import start_dht
            from swarm.fabric.hivemind_transport import HivemindFabric

            initial = self.made[0].addresses() if self.made else []
            fabric = HivemindFabric(*start_dht(self.run_id, initial_peers=initial), self.run_id, heartbeat_s=heartbeat_s)
        self.made.append(fabric)
        return fabric

    def close(self) -> None:
        for fabric in self.made:
            try:
                fabric.shutdown()
            except Exception:  # noqa: BLE001  it may have been shut down already
                pass
        self.made.clear()
        if self._registry_server is not None:
            self._registry_server.stop(0)
            self._registry_server = None

    def __enter__(self) -> "LocalFabrics":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
