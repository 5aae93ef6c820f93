"""Signatures, in one place: a peer's signing key (hivemind's RSAPrivateKey) and its public half in
the `[owner:...]` form (swarm.config.learner_keys), values signed under it, and their checks.

Over hivemind the DHT's RSASignatureValidator signs membership records and announcements; what is
signed outside the DHT (pushed announcements, the gRPC registry's announcements and every gRPC
request) is signed here, as PKCS#1 v1.5 over SHA-256 (hivemind's RSAPrivateKey.sign)."""

from __future__ import annotations

import msgpack

from swarm.config.learner_keys import is_owner_form, key_inside, owner_form

MAX_CLOCK_SKEW_S = 120.0  # how far a signer's clock may be from the checker's


def owner_key(private_key) -> bytes:
    """The `[owner:ssh-rsa ...]` form of a signing key's public half (as hivemind writes it)."""
    return owner_form(private_key.get_public_key().to_bytes())


def public_key(subkey: bytes):
    """hivemind's RSAPublicKey inside an `[owner:...]` subkey. Raises ValueError when it is not one."""
    from hivemind.utils.crypto import RSAPublicKey

    inside = key_inside(subkey)
    try:
        return RSAPublicKey.from_bytes(inside)
    except Exception as exc:  # noqa: BLE001  any parse failure means the same thing
        raise ValueError(f"a public key that does not parse ({type(exc).__name__})") from exc


def canonical_owner(subkey: bytes) -> bytes:
    """The one `[owner:...]` text of the key `subkey` names: parsed and written back as owner_key
    writes it (`ssh-rsa BASE64`, no comment), so that two texts of one key are one owner. Raises
    ValueError when it names no key. (The same name and contract as the gRPC hardening's.)"""
    return owner_form(public_key(subkey).to_bytes())


def verify_owner_signature(owner: bytes, payload: bytes, signature: bytes) -> bool:
    """Whether `signature` is the signature of `payload` by the key `owner` names."""
    if not is_owner_form(owner):
        return False
    try:
        return public_key(owner).verify(payload, signature)
    except Exception:  # noqa: BLE001  a key that does not parse verifies nothing
        return False


def signed_value(private_key, value: dict) -> dict:
    """`value` packed (msgpack) and signed: {"owner", "payload", "signature"}, as a pushed
    announcement and a gRPC registry's announcement carry it."""
    payload = msgpack.packb(value, use_bin_type=True)
    return {"owner": owner_key(private_key), "payload": payload, "signature": private_key.sign(payload)}


def unpacked(payload: bytes):
    """A signed value's payload unpacked, or None when it is not msgpack."""
    try:
        return msgpack.unpackb(payload, raw=False)
    except Exception:  # noqa: BLE001  garbage, signed or not (msgpack raises several types)
        return None
