"""A learner whose run directory is on a real, small file system that fills up (a tmpfs of a few
MB, mounted and unmounted by the test: root only). torch.save raises RuntimeError there, not
OSError; whatever the failure, the learner warns, trains on in memory and retries at the next
checkpoint, and a half-written checkpoint is never left where it would be taken as the latest."""

import json
import os
import subprocess

import pytest

from benchmarks.waiting import wait_until
from swarm.checkpoint import PREFIX, latest_checkpoint
from swarm.cli.launcher import LocalSwarm
from swarm.runlog import read_jsonl
from tests.helpers.processes import kill_started

pytestmark = pytest.mark.slow
SAMPLER = ("--prompts-per-round", "2", "--num-generations", "4", "--progress-every-s", "1")
SMALL_MB = 6  # the embedded policy's weights (3.1 MB) fit, its AdamW state after them does not


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_MB}m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def events(run_dir, kind: str) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [e for e in read_jsonl(path) if e.get("event") == kind] if path.exists() else []


def test_a_full_disk_never_stops_the_learner_and_the_next_checkpoint_retries(small_disk, tmp_path):
    swarm = LocalSwarm(tmp_path, run_id="disk")
    run_dir = small_disk / "run"
    try:
        addr = swarm.start_bootstrap()
        learner, key = swarm.start_learner(addr, "--steps", "1000", "--groups-per-step", "1", "--checkpoint-every", "1",
                                           run_dir=run_dir)
        swarm.start_sampler("sampler-0", addr, key, *SAMPLER)
        logs = lambda: "\n".join(f"--- {p.name}:\n{p.text()[-1500:]}" for p in swarm.procs)  # noqa: E731
        wait_until(lambda: len(events(run_dir, "checkpoint_failed")) >= 2, 240, "two failed checkpoints", every=0.5, logs=logs)
        failed = events(run_dir, "checkpoint_failed")
        assert learner.popen.poll() is None  # still training
        assert any(e["error"].startswith("RuntimeError") for e in failed), failed  # torch.save's full disk
        assert "training goes on" in learner.text() and "next checkpoint retries" in learner.text()
        # nothing half-written is left, nor taken as the latest
        assert latest_checkpoint(run_dir) is None
        assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(PREFIX)]
        # space freed: the next checkpoint goes through, complete
        subprocess.run(["mount", "-o", "remount,size=256m", str(small_disk)], check=True)
        wait_until(lambda: events(run_dir, "checkpoint"), 120, "a checkpoint once there is room", every=0.5, logs=logs)
        saved = events(run_dir, "checkpoint")[0]
        assert saved["version"] > failed[0]["version"]
        latest = latest_checkpoint(run_dir)
        assert latest is not None and latest.version >= saved["version"]
        assert json.loads((latest.path / "state.json").read_text())["version"] == latest.version
        assert swarm.stop(learner) == 0, learner.text()[-3000:]
        # no failed checkpoint's temporary directory is left (looked for once the learner has stopped:
        # while it runs, the next checkpoint, every step here, is being written through one)
        assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    finally:
        kill_started(swarm)  # only the processes this test started, by pid
