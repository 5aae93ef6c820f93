"""The `[owner:...]` form of a signing key's public half, as hivemind's RSASignatureValidator writes
it, and `--learner-key` tokens: that form in base64, as a learner prints it at start-up.

It sits with the config because the learner keys a sampler is given are settings, checked when its
config is read; swarm.fabric.signing builds on it (signatures, keys parsed to RSA)."""

from __future__ import annotations

import base64

OWNER_PREFIX, OWNER_SUFFIX = b"[owner:", b"]"


def is_owner_form(subkey: bytes) -> bool:
    """Whether `subkey` has the `[owner:...]` form (not whether the key inside parses)."""
    return isinstance(subkey, bytes) and subkey.startswith(OWNER_PREFIX) and subkey.endswith(OWNER_SUFFIX)


def owner_form(public_key_bytes: bytes) -> bytes:
    """`[owner:KEY]` around a public key's bytes."""
    return OWNER_PREFIX + public_key_bytes + OWNER_SUFFIX


def key_inside(subkey: bytes) -> bytes:
    """The public key's bytes inside an `[owner:...]` subkey. Raises ValueError for another form."""
    if not is_owner_form(subkey):
        raise ValueError("not a peer's public key: expected the [owner:...] form")
    return subkey[len(OWNER_PREFIX):-len(OWNER_SUFFIX)]


def encode_learner_key(public_key_subkey: bytes) -> str:
    """The `[owner:...]` bytes of a learner's signing key, as one printable token (`--learner-key`)."""
    return base64.urlsafe_b64encode(public_key_subkey).decode()


def decode_learner_key(text: str) -> bytes:
    try:
        raw = base64.urlsafe_b64decode(text.encode())
    except (ValueError, TypeError) as exc:
        raise ValueError(f"learner key {text[:20]!r}... is not the token a learner prints at start-up") from exc
    if not is_owner_form(raw):
        raise ValueError("learner key is not the token a learner prints at start-up (swarm learner shows it)")
    return raw
