"""Shared fixtures. Tests keep torch to the two cores CI has and to deterministic seeds."""

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:  # property tests: the same examples on every CI run (a failure there is reproducible); new ones locally
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("ci", derandomize=True, database=None)
    if os.environ.get("CI"):
        _hypothesis_settings.load_profile("ci")
except ImportError:
    pass


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
    from swarm.fabric.local import LocalFabrics

    with LocalFabrics(request.param, TRANSPORT_RUN) as fabrics:
        def make(heartbeat_s: float = 1.0):
            return fabrics.make(heartbeat_s)

        make.transport = request.param
        yield make
