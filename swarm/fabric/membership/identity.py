"""Persistent identities.

Two keys per peer, each in a file so that it survives restarts:
- the libp2p identity (`*.p2p.key`), handed to the p2p daemon: it fixes the peer id and with it the
  multiaddr others pass to `--peers`;
- the RSA signing key (`*.sign.key`, DER), which signs the peer's DHT records so that no other peer
  can write or overwrite them (hivemind's RSASignatureValidator). Its public half's text form, and
  learner keys as `--learner-key` text, are swarm/config/learner_keys.py's.
"""

from __future__ import annotations

import os
from pathlib import Path

from swarm.paths import cache_root


def default_identity_dir() -> Path:
    return cache_root() / "identity"


def load_or_create_signing_key(path: Path):
    """An RSAPrivateKey read from `path`, or a new one written there (mode 0600) if it is missing."""
    from cryptography.hazmat.primitives import serialization
    from hivemind.utils.crypto import RSAPrivateKey

    path = Path(path)
    if path.exists():
        try:
            key = RSAPrivateKey.__new__(RSAPrivateKey)
            key.__setstate__({"_private_key": path.read_bytes()})
            return key
        except ValueError as exc:
            # never advise deleting it: a learner's key may be the run owner's, which samplers pin
            raise ValueError(f"signing key file {path} is not a DER RSA private key ({exc}); restore it from a backup "
                             "(a learner's key may be its run's owner key: a new one would not be trusted by the run)") from exc
    key = RSAPrivateKey()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key._private_key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL,
                                               serialization.NoEncryption()))
    tmp.rename(path)
    return key


def first_learner_key_file(identity_dir: Path) -> Path:
    """The signing key file of the first learner slot in `identity_dir` (claim_identity_slot's "learner"):
    the key a learner started from there runs with while no other learner holds that slot."""
    return Path(identity_dir) / "learner.sign.key"


def load_existing_signing_key(path: Path):
    """The RSAPrivateKey in `path`, which must exist (a run owner's key is never made by accident)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no signing key at {path}; the first learner's ready.json names its owner_key_file")
    try:
        return load_or_create_signing_key(path)
    except PermissionError:
        raise PermissionError(f"the run owner's key {path} cannot be read by this user: check its permissions and owner "
                              "(it should be mode 0600, owned by you); keep the file, it is the run's authority") from None
    except ValueError as exc:
        raise ValueError(f"the run owner's key {path} is not a DER RSA private key ({exc.__cause__ or exc}): check that "
                         "this is the owner_key_file the first learner's ready.json names, or restore it from your "
                         "backup. Keep the file: the run's samplers trust only this key's certificates") from None


_held_locks: list = []  # open lock files: the lock lasts as long as the process


def claim_identity_slot(identity_dir: Path, role: str, max_slots: int = 64) -> str:
    """A key-file stem for `role` that no other running peer in `identity_dir` uses: "sampler",
    then "sampler-1", ... Two samplers started by hand on one machine must not share a peer id; a
    restarted peer gets its old slot (and so its old peer id) back. Held by an flock until exit."""
    import fcntl

    identity_dir = Path(identity_dir)
    identity_dir.mkdir(parents=True, exist_ok=True)
    for slot in range(max_slots):
        stem = role if slot == 0 else f"{role}-{slot}"
        handle = open(identity_dir / f"{stem}.lock", "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            continue
        _held_locks.append(handle)
        return stem
    raise RuntimeError(f"{max_slots} {role}s already run from {identity_dir}; pass --identity-dir to give this one its own keys")


def identity_dir_or_default(identity_dir: Path | None) -> Path:
    return Path(identity_dir) if identity_dir else default_identity_dir()
