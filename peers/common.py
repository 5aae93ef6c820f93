"""What sampler and learner peers share: joining the swarm with persistent keys, and learner keys
as text (samplers are told which learner keys may publish weights)."""

from __future__ import annotations

import base64
from pathlib import Path


def encode_learner_key(public_key_subkey: bytes) -> str:
    """The `[owner:...]` bytes of a learner's signing key, as one printable token."""
    return base64.urlsafe_b64encode(public_key_subkey).decode()


def decode_learner_key(text: str) -> bytes:
    try:
        raw = base64.urlsafe_b64decode(text.encode())
    except (ValueError, TypeError) as exc:
        raise ValueError(f"learner key {text[:20]!r}... is not the token a learner prints at start-up") from exc
    if not raw.startswith(b"[owner:") or not raw.endswith(b"]"):
        raise ValueError("learner key is not the token a learner prints at start-up (swarm learner shows it)")
    return raw


def join(config, role: str):
    """This peer's fabric for `config` (a PeerConfig): hivemind (DHT + p2p streams) or gRPC."""
    if config.transport == "grpc":
        from swarm.fabric.grpc_peer import join_grpc as join_transport
    else:
        from swarm.fabric.hivemind_transport import join_hivemind as join_transport
    return join_transport(config.run_id, config.peers, identity_dir(config), role, config.host, config.port,
                          heartbeat_s=config.heartbeat_s)


def identity_dir(config) -> Path:
    from swarm.fabric.identity import default_identity_dir

    return Path(config.identity_dir) if config.identity_dir else default_identity_dir()


def load_problems(config, tokenizer, split: str = "train"):
    """The task's problems for `split` (same ids on every peer, so a learner can check answers)."""
    from swarm.tasks import load_task

    problems = list(load_task(config.task, tokenizer=tokenizer, **config.task_options()).problems(split))
    if not problems:
        raise ValueError(f"task {config.task!r} has no {split} problems")
    return problems


def install_stop_signals(stop) -> None:
    """SIGINT/SIGTERM set `stop`, so a peer finishes its round, checkpoints and leaves cleanly."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
