"""--resume-from PATH: the learner continues from the checkpoint chosen (not the newest), in its
own run directory or in a new one; anything that is not a checkpoint is a clear error."""

import os
import subprocess
import sys

import pytest
import torch

from peers.learner_setup import check_run_dir
from swarm.checkpoint import load_verified, save_checkpoint
from swarm.config import LearnerConfig
from swarm.fabric.weights.delta import state_hash
from swarm.tied_weights import unique_state
from swarm.model.loading import load_policy
from swarm.training import LearnerCore

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmPeer"


def build(model, tokenizer):
    return LearnerCore(model, tokenizer.pad_token_id)


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """A run directory with checkpoints at versions 2 and 4 (different weights)."""
    run_dir = tmp_path_factory.mktemp("run-a")
    model, tokenizer = load_policy("embedded")
    core = build(model, tokenizer)
    for version in (2, 4):
        with torch.no_grad():
            next(model.parameters()).add_(0.01)
        digest = state_hash(unique_state(model))
        save_checkpoint(run_dir, model, tokenizer, core.optimizer, version=version, digest=digest, config={})
    return run_dir


def test_resume_from_an_older_checkpoint_of_the_same_run(run_a):
    chosen_path = run_a / "checkpoints" / "version-000002"
    run_dir, chosen = check_run_dir(LearnerConfig(peers=[PEER], run_dir=run_a, resume_from=chosen_path))
    assert run_dir == run_a and chosen.version == 2  # not the newest (4)
    checkpoint, core, _ = load_verified(run_dir, build, chosen=chosen)
    assert checkpoint.version == 2
    assert state_hash(unique_state(core.model)) == chosen.hash


def test_resume_from_another_runs_checkpoint_needs_a_new_run_directory(run_a, tmp_path):
    chosen_path = run_a / "checkpoints" / "version-000004"
    _, chosen = check_run_dir(LearnerConfig(peers=[PEER], run_dir=tmp_path / "new", resume_from=chosen_path))
    assert chosen.version == 4
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "steps.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="is a checkpoint of another run, and run directory .* already holds a run"):
        check_run_dir(LearnerConfig(peers=[PEER], run_dir=busy, resume_from=chosen_path))


def test_a_damaged_chosen_checkpoint_is_an_error_not_a_fallback(run_a, tmp_path):
    import shutil

    copy = tmp_path / "run" / "checkpoints" / "version-000004"
    shutil.copytree(run_a / "checkpoints" / "version-000004", copy)
    (copy / "optimizer.pt").write_bytes(b"garbage")
    _, chosen = check_run_dir(LearnerConfig(peers=[PEER], run_dir=tmp_path / "run", resume_from=copy))
    with pytest.raises(ValueError, match="--resume-from .*version-000004 is damaged"):
        load_verified(tmp_path / "run", build, chosen=chosen)


def test_the_learner_command_refuses_what_is_not_a_checkpoint(tmp_path):
    not_one = tmp_path / "not-a-checkpoint"
    not_one.mkdir()
    for path, message in ((not_one, f"--resume-from {not_one} is not a checkpoint: it holds no state.json"),
                          (tmp_path / "missing", f"--resume-from {tmp_path / 'missing'}: no such directory")):
        out = subprocess.run([sys.executable, "-m", "swarm.cli", "learner", "--peers", PEER, "--resume-from", str(path),
                              "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, PYTHONUNBUFFERED="1"))
        assert out.returncode == 2, out.stderr[-2000:]
        assert message in " ".join(out.stderr.split()) and "RUN_DIR/checkpoints/version-" in out.stderr
        assert not (tmp_path / "run").exists()  # nothing made
