"""Learner checkpoints: `run_dir/checkpoints/version-000042/` holds the policy in Hugging Face
format (config.json, model.safetensors, tokenizer files: `transformers` and vLLM load it as a model
directory), the optimizer state, and state.json (version, weights hash, configuration).

A checkpoint is written to a temporary directory and renamed into place only when complete, so a
learner killed while saving never leaves a half-written checkpoint that `latest_checkpoint` would
pick up; only the newest `keep` are kept.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

PREFIX = "version-"
STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.pt"


@dataclass
class Checkpoint:
    path: Path
    version: int
    hash: str
    config: dict


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: Path, model, tokenizer, optimizer, *, version: int, digest: str, config: dict,
                    keep: int = 3) -> Path:
    root = checkpoint_dir(run_dir)
    final = root / f"{PREFIX}{version:06d}"
    if (final / STATE_FILE).exists():
        return final  # this version is already saved (e.g. checkpoint-every hit just before exit)
    tmp = root / f".tmp-{final.name}-{time.time_ns()}"
    tmp.mkdir(parents=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        (tmp / STATE_FILE).write_text(json.dumps({"version": version, "hash": digest, "config": config, "time": time.time()}, indent=2))
        if final.exists():  # a leftover without state.json: incomplete, replace it
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old.path, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(run_dir)
    found = []
    for path in root.glob(f"{PREFIX}*") if root.exists() else ():
        try:
            state = json.loads((path / STATE_FILE).read_text())
            found.append(Checkpoint(path, int(state["version"]), str(state["hash"]), dict(state.get("config", {}))))
        except (OSError, ValueError, KeyError):
            continue  # incomplete or foreign: never resumed from
    return sorted(found, key=lambda c: c.version)


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_optimizer_state(checkpoint: Checkpoint, optimizer) -> None:
    optimizer.load_state_dict(torch.load(checkpoint.path / OPTIMIZER_FILE, map_location="cpu", weights_only=True))
