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


# `bash dev.sh test` runs the suite in two lanes (pytest -n 2 --dist loadgroup), one per core CI has:
# the tests that train or start many peer processes (CPU-bound) in one, those that mostly wait on
# shaped links, timers and sockets in the other. A file is in the waiting lane when listed here.
WAITING_LANE = {
    "test_wan.py", "test_wan_relay.py", "test_wan_harness.py", "test_across_machines.py", "test_dashboard.py",
    "test_chunks.py", "test_announcement_push.py", "test_weight_versions.py", "test_fabric.py", "test_fabric_interface.py", "test_membership.py",
    "test_rollout_exchange.py", "test_grpc_hostile.py", "test_registry.py", "test_fuzz.py", "test_fuzz_peers.py",
    "test_fuzz_payloads.py", "test_progress.py", "test_stream_close.py", "test_status_flags.py", "test_layers.py",
}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group("waiting" if item.path.name in WAITING_LANE else "working"))


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)
    # one thread per lane when the two lanes share the cores
    lanes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // lanes))


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
