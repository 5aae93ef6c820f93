"""Shared fixtures. Tests keep torch to the two cores CI has and to deterministic seeds."""

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(min(2, os.cpu_count() or 1))


TRANSPORT_RUN = "transport-test"


@pytest.fixture(params=["hivemind", "grpc"])
def make_fabric(request):
    """Factory of real peers on loopback for the transport named by the test's parameter: hivemind
    (each later peer joins through the first one's DHT node) or gRPC (all join one registry
    server, as they would join `swarm bootstrap --transport grpc`). `make.transport` names it."""
    transport = request.param
    made = []
    registry_server = None
    if transport == "grpc":
        from swarm.fabric.grpc_transport import Registry, serve_registry

        registry_server, port = serve_registry(Registry())
        registry = f"127.0.0.1:{port}"

    def make(heartbeat_s: float = 1.0):
        if transport == "grpc":
            from hivemind.utils.crypto import RSAPrivateKey

            from swarm.fabric.grpc_peer import GrpcFabric

            fabric = GrpcFabric(registry, TRANSPORT_RUN, RSAPrivateKey(), heartbeat_s=heartbeat_s)
        else:
            from swarm.fabric.dht import start_dht
            from swarm.fabric.hivemind_transport import HivemindFabric

            initial = made[0].addresses() if made else []
            fabric = HivemindFabric(*start_dht(TRANSPORT_RUN, initial_peers=initial), TRANSPORT_RUN, heartbeat_s=heartbeat_s)
        made.append(fabric)
        return fabric

    make.transport = transport
    yield make
    for fabric in made:
        try:
            fabric.shutdown()
        except Exception:  # noqa: BLE001  a test may have shut it down already
            pass
    if registry_server is not None:
        registry_server.stop(0)
