"""Signatures, in one place: a peer's signing key (hivemind's RSAPrivateKey) and its public half in
the `[owner:...]` form (swarm.config.learner_keys), values signed under it, and their checks.

Over hivemind the DHT's RSASignatureValidator signs membership records and announcements; what is
signed outside the DHT (pushed announcements, the gRPC registry's announcements and every gRPC
request) is signed here, as PKCS#1 v1.5 over SHA-256 (hivemind's RSAPrivateKey.sign).

One owner is one key, whatever its text says: the `[owner:...]` text of a key has many spellings
(an OpenSSH line takes a trailing comment, extra spaces), so anything that counts, ranks or names
owners goes by `owner_id` (a hash of the key's DER SubjectPublicKeyInfo) or `canonical_owner`
(the one text owner_key writes), never by the bytes a peer sent. A public exponent other than
65537 is refused as well: whoever knows a modulus' factors could otherwise make any number of
keys from it at no cost."""

from __future__ import annotations

import base64
import binascii
import hashlib
from functools import lru_cache

import msgpack

from swarm.config.learner_keys import is_owner_form, key_inside, owner_form

MAX_CLOCK_SKEW_S = 120.0  # how far a signer's clock may be from the checker's
PUBLIC_EXPONENT = 65537  # hivemind's RSAPrivateKey always uses it
KEY_BITS = (2048, 4096)  # the key sizes taken: big enough to be a key, small enough to check cheaply


def owner_key(private_key) -> bytes:
    """The `[owner:ssh-rsa ...]` form of a signing key's public half (as hivemind writes it)."""
    return owner_form(private_key.get_public_key().to_bytes())


def public_key(subkey: bytes):
    """hivemind's RSAPublicKey inside an `[owner:...]` subkey. Raises ValueError when it is not one."""
    from hivemind.utils.crypto import RSAPublicKey

    inside = key_inside(subkey)
    try:
        key = RSAPublicKey.from_bytes(inside)
    except Exception as exc:  # noqa: BLE001  any parse failure means the same thing
        raise ValueError(f"a public key that does not parse ({type(exc).__name__})") from exc
    numbers = key._public_key.public_numbers()
    if numbers.e != PUBLIC_EXPONENT or not KEY_BITS[0] <= numbers.n.bit_length() <= KEY_BITS[1]:
        raise ValueError(f"an RSA key of {numbers.n.bit_length()} bits with exponent {numbers.e}: peers' keys have "
                         f"{KEY_BITS[0]}..{KEY_BITS[1]} bits and exponent {PUBLIC_EXPONENT} (hivemind's RSAPrivateKey)")
    return key


def public_key_der(key) -> bytes:
    """The DER SubjectPublicKeyInfo of a `cryptography` public key: one byte string per key."""
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def id_of_public_key(key) -> str:
    """An owner's id from its `cryptography` public key (a TLS certificate's, say): 16 hex
    characters of the SHA-256 of its DER SubjectPublicKeyInfo. Taking another key's id means
    finding a second key with the same 64-bit prefix."""
    return hashlib.sha256(public_key_der(key)).hexdigest()[:16]


_parsed = lru_cache(maxsize=4096)(public_key)  # peers sign every request with the same few keys: parse each once


@lru_cache(maxsize=4096)  # (as _parsed) every request with the same few keys: parse each once
def _canonical(subkey: bytes) -> tuple[bytes, str]:
    key = _parsed(subkey)
    return owner_form(key.to_bytes()), id_of_public_key(key._public_key)


def canonical_owner(subkey: bytes) -> bytes:
    """The one `[owner:...]` text of the key `subkey` names (as owner_key writes it). Raises
    ValueError when it names no acceptable key."""
    return _canonical(subkey)[0]


def is_canonical_owner(subkey) -> bool:
    """Whether `subkey` is an acceptable key in its one canonical `[owner:...]` text (as owner_key
    writes it): a DHT record stored under another spelling of a key is not that key's record."""
    try:
        return isinstance(subkey, bytes) and canonical_owner(subkey) == subkey
    except ValueError:
        return False


def owner_id(subkey: bytes) -> str:
    """The id of the key an `[owner:...]` subkey names, however it is spelt (see id_of_public_key).
    Raises ValueError when it names no acceptable key."""
    return _canonical(subkey)[1]


def signature_digest(signature: bytes) -> bytes:
    """A digest naming a signature whatever its spelling (hivemind's signatures are base64, and its
    decoder skips characters outside the alphabet), for a memory of signatures already seen.
    Raises ValueError when it is not base64."""
    try:
        return hashlib.sha256(base64.b64decode(signature, validate=True)).digest()
    except (binascii.Error, ValueError) as exc:
        raise ValueError("a signature that is not base64") from exc


def verify_owner_signature(owner: bytes, payload: bytes, signature: bytes) -> bool:
    """Whether `signature` is the signature of `payload` by the key `owner` names."""
    if not is_owner_form(owner):
        return False
    try:
        return _parsed(owner).verify(payload, signature)
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
