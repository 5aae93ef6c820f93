"""What a learner settles before it trains: whether its run directory holds a run to resume (and
from which checkpoint), where its versions are encoded, the last version it published or logged,
and the team of learners it joins (over hivemind, with its certificate checked)."""

from __future__ import annotations

import json
from pathlib import Path

from swarm.checkpoint import checkpoint_dir, latest_checkpoint, read_checkpoint
from swarm.config import LearnerConfig
from swarm.config.learner_keys import encode_learner_key
from swarm.fabric.membership.authority import parse, read_certificate
from swarm.team import LearnerTeam, float32_hash


# a CPU learner's versions from this size up are encoded in a process at idle priority; below it
# (the embedded model's, a few MB) encoding one costs milliseconds, and a thread no child or shared memory
PROCESS_MIN_BYTES = 32 << 20


def publish_isolation(setting: str, device, state_bytes: int) -> tuple[str, bool]:
    """(where versions are encoded, whether at idle priority: swarm.fabric.weights.publisher), from
    LearnerConfig.publish_isolation. "auto" is a process of its own for a GPU learner (whose
    training thread needs the GIL for its kernel launches: 1.99 s steps instead of 1.19 s on an H100
    with the codec in a thread), and for a CPU learner publishing `state_bytes` of at least
    PROCESS_MIN_BYTES, at idle priority (its training keeps every core busy: on the mid-size model
    0.944-1.053x of the steps/s with publishing off, against 0.79-0.91x in a thread); else the
    learner's thread."""
    cuda = str(device).startswith("cuda")
    if setting == "auto":
        setting = "process" if cuda or state_bytes >= PROCESS_MIN_BYTES else "thread"
    return setting, setting == "process" and not cuda


def published_version(run_dir: Path) -> int | None:
    try:
        return int(json.loads((run_dir / "published.json").read_text())["version"])
    except (OSError, ValueError, KeyError):
        return None


def logged_version(run_dir: Path) -> int | None:
    """The version of the last step record in steps.jsonl (a version trained, maybe never published:
    publishing runs behind training)."""
    try:
        with (run_dir / "steps.jsonl").open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - 65536))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["version"])
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line, or the start of one cut by the seek
    return None


def check_run_dir(config: LearnerConfig) -> tuple[Path, object]:
    """(run_dir, checkpoint to resume from or None); refuses to mix a fresh run into an old one.
    Makes nothing: a fresh run's directory is made once its model and task have loaded."""
    run_dir = Path(config.run_dir)
    found = latest_checkpoint(run_dir)
    if config.resume_from is not None:  # --resume-from: that checkpoint, in its own run or in a new one
        chosen = read_checkpoint(config.resume_from)
        own = chosen.path.resolve().parent == checkpoint_dir(run_dir).resolve()
        if not own and (found is not None or (run_dir / "steps.jsonl").exists()):
            raise ValueError(f"--resume-from {chosen.path} is a checkpoint of another run, and run directory {run_dir} "
                             "already holds a run; choose a new --run-dir to continue from it there")
        return run_dir, chosen
    if config.resume and found is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}; drop --resume to start a new run")
    if not config.resume and (found is not None or (run_dir / "steps.jsonl").exists()):
        raise ValueError(f"run directory {run_dir} already holds a run; pass --resume to continue it or choose another --run-dir")
    return run_dir, found


def join_team(config: LearnerConfig, fabric, core, events, echo) -> LearnerTeam | None:
    """This learner's LearnerTeam (swarm.team) over hivemind; None over gRPC, which has no
    averaging (a --certificate there is refused). Checks the certificate names this learner and run."""
    certificate = read_certificate(config.certificate) if config.certificate else ""
    if fabric.transport != "hivemind":
        if certificate:
            raise ValueError("--certificate: several learners average gradients through hivemind; use --transport hivemind")
        return None
    if certificate:
        cert = parse(certificate)
        if cert.learner != fabric.public_key:
            raise ValueError(f"--certificate was issued for another learner key; this learner's key is "
                             f"{encode_learner_key(fabric.public_key)} (its --identity-dir): ask the run owner for "
                             f"`swarm authorize --learner-key {encode_learner_key(fabric.public_key)} --run-id {config.run_id}`")
        if cert.run_id != config.run_id:
            raise ValueError(f"--certificate is for run '{cert.run_id}', not '{config.run_id}'")
        fabric.certificate = certificate
    team = LearnerTeam(fabric, core, frozenset({parse(certificate).owner if certificate else fabric.public_key}),
                       weights_hash=lambda: float32_hash(core.model), averaging_timeout_s=config.averaging_timeout_s,
                       events=events, echo=echo)
    team.joining = bool(certificate)
    return team
