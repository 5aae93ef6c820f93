"""Shared fixtures. Tests keep torch to the two cores CI has and to deterministic seeds."""

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The processes tests start (peers, `swarm` commands, benchmark runs) take the same share of the cores
# as this lane's torch (the _seed fixture below): with two lanes on two cores, a second torch thread
# in each of several processes only spins against the others (benchmarks/gpu_check.py measured tiny
# learner steps 8x slower with two threads on two busy cores). LocalSwarm already starts its peers so.
_LANES = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, min(2, os.cpu_count() or 1) // _LANES)))

try:  # property tests: the same examples on every CI run (a failure there is reproducible); new ones locally
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("ci", derandomize=True, database=None)
    if os.environ.get("CI"):
        _hypothesis_settings.load_profile("ci")
except ImportError:
    pass


# `bash dev.sh test` runs the suite in two lanes (pytest -n 2 --dist loadgroup), one per core CI has:
# the tests that train or start many peer processes (CPU-bound) in one, those that mostly wait on
# shaped links, timers and sockets in the other. A file is in the waiting lane when listed here
# (and floats when listed in FLOATING below).
# Beware: pytest-xdist 3.8 marks a group by appending "@group" to the item's legacy _nodeid, which
# pytest 9.2 no longer reads (structured node ids; pytest-dev/pytest-xdist#1386, fix in #1388). With
# those versions every test is its own unit, handed to whichever worker is free: no lanes at all,
# two peer-starting tests may overlap. pyproject.toml's dev extra keeps pytest below 9.2 for that.
WAITING_LANE = {
    "test_wan.py", "test_wan_relay.py", "test_wan_harness.py", "test_across_machines.py", "test_dashboard.py",
    "test_chunks.py", "test_announcement_push.py", "test_weight_versions.py", "test_fabric.py", "test_fabric_interface.py", "test_membership.py",
    "test_rollout_exchange.py", "test_grpc_hostile.py", "test_registry.py", "test_fuzz.py", "test_fuzz_peers.py",
    "test_fuzz_payloads.py", "test_progress.py", "test_stream_close.py", "test_status_flags.py", "test_layers.py",
    # start peers, but spend most of their time waiting for signals, ports and exits: here they even
    # the lanes out (the full suite on 2 cores: working 1,256 s against waiting 842 s of its 60 longest tests)
    "test_stops.py", "test_newcomer.py",
}

# Files that start no peers and time nothing (in-process unit tests, and benchmark runs in a
# subprocess with generous timeouts) float: each is a group of its own, which pytest-xdist hands to
# whichever lane is nearly done with its own tests (loadgroup sorts the groups by size, so the two
# lanes take "working" and "waiting" first, being larger than any one of these). The lanes then end
# together instead of one waiting on the other.
FLOATING = {
    "test_losses.py", "test_losses_diagnostics.py", "test_losses_off_policy.py", "test_advantages.py", "test_loss_smoke.py",
    "test_losses_staleness_filter.py", "test_learner_guards.py", "test_micro_batches.py", "test_staleness.py",
    "test_vllm_update.py", "test_verification.py", "test_generation.py", "test_gpu.py", "test_intake.py",
    "test_pass_at_k.py", "test_reward_funcs.py", "test_rewards.py", "test_tasks.py", "test_max_prompt_length.py",
    "test_lr_schedule.py", "test_chunked_head.py", "test_weight_format.py", "test_weight_delta.py", "test_delta_format.py", "test_delta_reference.py",
    "test_version_memory_shapes.py", "test_staleness_study.py", "test_gpu_check.py", "test_learner_speed.py", "test_lora_sizes.py",
}


# Floating files whose tests each float on their own: each test runs its own benchmark processes
# (no module-scoped fixtures to share), and together they are too long to hand over as one piece
# (the study's tests 260 s, the GPU check's 140 s on the 2-core machine): one such file taken last
# by the lane that finished first kept the other lane's core idle for minutes.
FLOATING_EACH = {"test_staleness_study.py", "test_gpu_check.py"}


def lane_of(path, test: str = "") -> str:
    if path.name in FLOATING_EACH:
        return f"floating:{path.name}::{test}"
    if path.name in FLOATING:
        return f"floating:{path.name}"
    return "waiting" if path.name in WAITING_LANE else "working"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(lane_of(item.path, item.name)))


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
