"""Learner checkpoints: `run_dir/checkpoints/version-000042/` holds the policy in Hugging Face
format (config.json, model.safetensors, tokenizer files: `transformers` and vLLM load it as a model
directory), the optimizer state, and state.json (version, weights hash, configuration). A LoRA run's
holds the adapter alone in PEFT's format (adapter_config.json, adapter_model.safetensors), and its
state.json the hash of the base model (`--model`) it was trained on, checked when it is resumed.

A checkpoint is written to a temporary directory, flushed to disk and renamed into place only when
complete, so a learner killed while saving never leaves a half-written checkpoint that
`latest_checkpoint` would pick up; only the newest `keep` are kept. `load_verified` resumes from the
newest checkpoint whose weights still match the hash in its state.json, falling back to older ones
(with a warning naming what was wrong) when the newest is damaged.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.fabric.weights.delta import legacy_state_hash, state_hash
from swarm.model.loading import load_policy
from swarm.progress import Progress, ProgressTask
from swarm.lora import base_state, is_adapter_dir, peft_quietly, policy_state

logger = logging.getLogger(__name__)
PROGRESS_AFTER_S = 2.0  # checkpoints quicker than this show no progress (the embedded policy's take ~0.1 s)
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
                    keep: int = 3, progress: Progress | None = None, base_hash: str = "") -> Path:
    """Write version `version`'s checkpoint (see the module's docstring); `progress` hears of the
    bytes written (weights, then optimizer state, then flushed to disk) once it takes a while."""
    root = checkpoint_dir(run_dir)
    for partial in root.glob(".tmp-*"):  # left by a writer killed mid-checkpoint (SIGKILL): never complete
        shutil.rmtree(partial, ignore_errors=True)
    final = root / f"{PREFIX}{version:06d}"
    if (final / STATE_FILE).exists():
        return final  # this version is already saved (e.g. checkpoint-every hit just before exit)
    tmp = root / f".tmp-{final.name}-{time.time_ns()}"
    tmp.mkdir(parents=True)
    task = progress.task(f"checkpoint of version {version}", total=_expected_bytes(model, optimizer), unit="bytes",
                         delay_s=PROGRESS_AFTER_S) if progress is not None else nullcontext()
    try:
        with task:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            _written(task, tmp, "weights written")
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
            state = {"version": version, "hash": digest, "config": config, "time": time.time(),
                     **({"base_hash": base_hash} if base_hash else {})}
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
            _written(task, tmp, "flushing to disk", last=True)
            _fsync_files(tmp)  # the rename must not reach the disk before the files it names
            if final.exists():  # a leftover without state.json: incomplete, replace it
                shutil.rmtree(final)
            tmp.rename(final)
            _fsync_directory(root)  # the rename itself reaches the disk
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old.path, ignore_errors=True)
    return final


def _expected_bytes(model, optimizer) -> int:
    """About what a checkpoint writes: the weights and the optimizer's tensors, as held in memory."""
    tensors = [*model.state_dict().values(), *(v for state in optimizer.state.values() for v in state.values())]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _written(task, directory: Path, note: str, *, last: bool = False) -> None:
    """Tell `task` (a ProgressTask, or a null context) the bytes now in `directory` (`last`: all of them)."""
    if isinstance(task, ProgressTask):
        done = sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
        task.update(completed=done, total=done if last else max(done, task.total or 0), note=note)


def _fsync_files(directory: Path) -> None:
    for path in directory.iterdir():
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def read_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint in directory `path` (`--resume-from`); ValueError saying what is wrong when it is not one."""
    path = Path(path)
    example = "a directory like RUN_DIR/checkpoints/version-000042 (a learner's run directory lists them)"
    if not path.is_dir():
        raise ValueError(f"--resume-from {path}: no such directory; pass {example}")
    try:
        state = json.loads((path / STATE_FILE).read_text())
        checkpoint = Checkpoint(path, int(state["version"]), str(state["hash"]), dict(state.get("config", {})))
    except OSError:
        raise ValueError(f"--resume-from {path} is not a checkpoint: it holds no {STATE_FILE}; pass {example}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--resume-from {path} is not a complete checkpoint: its {STATE_FILE} is damaged ({exc!r}); "
                         f"pass another of {path.parent}") from None
    if not (path / OPTIMIZER_FILE).is_file():
        raise ValueError(f"--resume-from {path} is not a complete checkpoint: it holds no {OPTIMIZER_FILE}; pass another "
                         f"of {path.parent}")
    return checkpoint


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_optimizer_state(checkpoint: Checkpoint, optimizer) -> None:
    optimizer.load_state_dict(torch.load(checkpoint.path / OPTIMIZER_FILE, map_location="cpu", weights_only=True))


def _legacy_match(model, digest: str) -> bool:
    """Whether `digest` is the hash a checkpoint written before weight format 4 recorded: sha256 over
    every name of state_dict(), tied aliases included (such checkpoints still resume)."""
    return legacy_state_hash({k: v.detach() for k, v in model.state_dict().items()}) == digest


def load_verified(run_dir: Path, build_learner, *, warn=logger.warning, chosen: Checkpoint | None = None):
    """(checkpoint, learner, tokenizer) from the newest checkpoint that loads and whose weights hash
    to what its state.json says; a damaged newer one is skipped with a `warn`ing.
    `build_learner(model, tokenizer)` makes the learner (anything with an `optimizer`) that the
    saved optimizer state is loaded into. Raises FileNotFoundError when no checkpoint is usable.
    With `chosen` (`--resume-from`), that checkpoint alone: damaged, it is a ValueError, not a fallback."""
    if chosen is not None:
        try:
            return _load_one(chosen, build_learner)
        except Exception as exc:  # noqa: BLE001  any damage: said, never replaced by another checkpoint
            raise ValueError(f"--resume-from {chosen.path} is damaged ({type(exc).__name__}: {exc}); pass another "
                             f"checkpoint of {chosen.path.parent}") from exc
    found = list_checkpoints(run_dir)
    for checkpoint in reversed(found):
        try:
            return _load_one(checkpoint, build_learner)
        except Exception as exc:  # noqa: BLE001  any damage: try the previous checkpoint
            warn(f"checkpoint {checkpoint.path} is damaged ({type(exc).__name__}: {exc}); trying an older one")
    raise FileNotFoundError(f"no usable checkpoint in {checkpoint_dir(run_dir)} ({len(found)} found, all damaged)")


def _load_one(checkpoint: Checkpoint, build_learner):
    """(checkpoint, learner, tokenizer) from one checkpoint whose weights hash as its state.json says."""
    model, tokenizer = _load_model(checkpoint)
    digest = state_hash(policy_state(model))  # as the learner hashed it: a tied parameter once, or the adapter
    if digest != checkpoint.hash and not _legacy_match(model, checkpoint.hash):
        raise ValueError(f"its weights hash to {digest[:12]}..., not {checkpoint.hash[:12]}... as state.json says")
    learner = build_learner(model, tokenizer)
    load_optimizer_state(checkpoint, learner.optimizer)
    return checkpoint, learner, tokenizer


def _load_model(checkpoint: Checkpoint):
    """The checkpoint's policy: its own weights, or a LoRA run's base model (`--model` of its config,
    checked against the base hash it recorded) with its adapter, trainable."""
    if not is_adapter_dir(checkpoint.path):
        return load_policy(str(checkpoint.path))
    from peft import PeftModel

    state = json.loads((checkpoint.path / STATE_FILE).read_text())
    base, tokenizer = load_policy(str(checkpoint.config.get("model", "embedded")))
    found = state_hash(base_state(base))
    if found != state.get("base_hash"):
        raise ValueError(f"the LoRA checkpoint was trained on base model {str(state.get('base_hash'))[:16]}..., but --model "
                         f"{checkpoint.config.get('model')!r} now holds {found[:16]}...; restore that base model")
    with peft_quietly():
        return PeftModel.from_pretrained(base, str(checkpoint.path), is_trainable=True), tokenizer
