"""What sampler and learner peers share: joining the swarm with persistent keys, and learner keys
as text (samplers are told which learner keys may publish weights)."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


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


@dataclass
class Joined:
    dht: object
    validator: object  # RSASignatureValidator holding this peer's signing key

    @property
    def public_key(self) -> bytes:
        return self.validator.local_public_key


def join(run_id: str, peers: Sequence[str], identity_dir: Path, role: str, host: str = "127.0.0.1", port: int = 0) -> Joined:
    from swarm.fabric.dht import start_dht
    from swarm.fabric.identity import load_or_create_signing_key

    identity_dir = Path(identity_dir)
    key = load_or_create_signing_key(identity_dir / f"{role}.sign.key")
    family = "ip6" if ":" in host else "ip4"
    dht, validator = start_dht(run_id, initial_peers=list(peers), host_maddrs=[f"/{family}/{host}/tcp/{port}"],
                               identity_path=identity_dir / f"{role}.p2p.key", signing_key=key)
    return Joined(dht, validator)
