"""Who may publish a run's versions: the run owner's key and the learner keys it certifies.

A run has one owner key, an RSA signing key like every peer's (swarm.fabric.membership.identity). By default
it is the first learner's own key, so a one-learner run is unchanged: samplers pin it with
`--learner-key`, which names the run, not one learner. To let another learner train the run, the
owner signs a certificate for that learner's key (`swarm authorize`); the learner carries the
certificate in every version announcement, and samplers and the other learners accept an
announcement when its key is the owner's or certified by it for this run.

A certificate is `BODY.SIGNATURE`, both base64url: BODY is canonical JSON of the run id, the
certified learner key, the owner key and the time it was issued; SIGNATURE is the owner's RSA
signature of BODY (hivemind's RSAPrivateKey, PKCS#1 v1.5 over SHA-256). Nothing else is trusted:
the learner key inside a certificate is only honoured for announcements that the DHT's signature
validator already proved were written by that key.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from swarm.fabric.signing import owner_key, public_key

MAX_CERTIFICATE_CHARS = 4096  # two RSA-2048 keys and a signature in base64 come to about 1.6 kB


class CertificateError(ValueError):
    """A certificate that is malformed, not signed by the owner, or for another run or learner."""


@dataclass(frozen=True)
class Certificate:
    run_id: str
    learner: bytes  # the certified learner's public-key subkey ("[owner:...]" bytes)
    owner: bytes  # the owner's public-key subkey
    issued: float
    token: str  # the text form, as carried in announcements and passed on the command line


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _public_key(subkey: bytes):
    """hivemind's RSAPublicKey inside an "[owner:...]" subkey."""
    try:
        return public_key(subkey)
    except ValueError as exc:
        raise CertificateError(f"a key in the certificate is not a peer's public key: {exc}") from exc


def issue(owner_private_key, run_id: str, learner: bytes, now: float | None = None) -> Certificate:
    """The owner's certificate that `learner` (a public-key subkey) may train and publish run `run_id`."""
    _public_key(learner)  # refuse to certify something that is not a key
    body = json.dumps({"run_id": run_id, "learner": _b64(learner), "owner": _b64(owner_key(owner_private_key)),
                       "issued": round(time.time() if now is None else now, 3)}, sort_keys=True, separators=(",", ":"))
    signature = owner_private_key.sign(body.encode())
    token = f"{_b64(body.encode())}.{_b64(signature)}"
    return Certificate(run_id, learner, owner_key(owner_private_key), json.loads(body)["issued"], token)


@lru_cache(maxsize=256)  # announcements are read every few seconds; an RSA check is not free
def parse(token: str) -> Certificate:
    """The certificate in `token`, its signature checked against the owner key it names (who the
    owner is, is for the caller to check: see `authorises`). Raises CertificateError."""
    if not isinstance(token, str) or len(token) > MAX_CERTIFICATE_CHARS or token.count(".") != 1:
        raise CertificateError("not a certificate: expected BODY.SIGNATURE as `swarm authorize` prints it")
    body_text, signature_text = token.split(".")
    try:
        body_bytes, signature = _unb64(body_text), _unb64(signature_text)
        body = json.loads(body_bytes)
        run_id, learner, owner, issued = body["run_id"], _unb64(body["learner"]), _unb64(body["owner"]), float(body["issued"])
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise CertificateError(f"not a certificate: its body does not parse ({type(exc).__name__})") from exc
    if not isinstance(run_id, str):
        raise CertificateError("not a certificate: its run id is not text")
    if not _public_key(owner).verify(body_bytes, signature):
        raise CertificateError("the certificate's signature is not its owner key's")
    _public_key(learner)
    return Certificate(run_id, learner, owner, issued, token)


def authorises(token: str, run_id: str, owners: frozenset[bytes] | set[bytes], learner: bytes) -> bool:
    """Whether `token` is a valid certificate, signed by one of `owners`, for `learner` in `run_id`."""
    try:
        cert = parse(token)
    except CertificateError:
        return False
    return cert.run_id == run_id and cert.owner in owners and cert.learner == learner


def read_certificate(value: str) -> str:
    """A certificate given on the command line: the token itself, or a file holding it."""
    text = value.strip()
    try:
        if Path(text).is_file():
            text = Path(text).read_text().strip()
    except OSError:  # a token is longer than a file name may be
        pass
    parse(text)  # a bad one fails at start-up, with its reason
    return text
