"""Who may publish a run's versions: the run owner's key and the learner keys it certifies.

A run has one owner key, an RSA signing key like every peer's (swarm.fabric.membership.identity). By default
it is the first learner's own key, so a one-learner run is unchanged: samplers pin it with
`--learner-key`, which names the run, not one learner. To let another learner train the run, the
owner signs a certificate for that learner's key (`swarm authorize`); the learner carries the
certificate in every version announcement, and samplers and the other learners accept an
announcement when its key is the owner's or certified by it for this run.

A certificate is `BODY.SIGNATURE`, both base64url: BODY is canonical JSON of the run id, the
certified learner key, the owner key, the time it was issued and the time it expires; SIGNATURE is
the owner's RSA signature of BODY (hivemind's RSAPrivateKey, PKCS#1 v1.5 over SHA-256). Nothing else
is trusted: the learner key inside a certificate is only honoured for announcements that the DHT's
signature validator already proved were written by that key. A certificate without an expiry (from
before expiries) is refused.

The owner takes a certificate back before it expires with a revocation list (`swarm authorize
--revoke KEY`): the same BODY.SIGNATURE form, BODY naming the run, the owner and the fingerprints of
the revoked learner keys. A newer list replaces an older one (it holds every key revoked so far);
samplers and learners read it from the swarm and refuse the keys it names.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from swarm.fabric.signing import canonical_owner, owner_key, public_key

MAX_CERTIFICATE_CHARS = 4096  # two RSA-2048 keys and a signature in base64 come to about 1.6 kB
CERTIFICATE_DAYS = 30.0  # how long a certificate is valid by default (`swarm authorize --days`)
MAX_CERTIFICATE_DAYS = 366.0  # the longest a certificate may be valid: a revocation must outlive it
MAX_REVOKED = 256  # keys one revocation list may name (a 64-character fingerprint each)
MAX_REVOCATION_CHARS = 24576  # MAX_REVOKED fingerprints, an owner key and a signature in base64


class CertificateError(ValueError):
    """A certificate that is malformed, not signed by the owner, or for another run or learner."""


@dataclass(frozen=True)
class Certificate:
    run_id: str
    learner: bytes  # the certified learner's public-key subkey ("[owner:...]" bytes)
    owner: bytes  # the owner's public-key subkey
    issued: float
    token: str  # the text form, as carried in announcements and passed on the command line
    expires: float = 0.0  # seconds since the epoch (time.time()) after which it is refused

    def problem(self, now: float | None = None, revoked: frozenset[str] | set[str] = frozenset()) -> str:
        """Why this certificate may not be used now ("" when it may): expired, or its key revoked."""
        key = key_fingerprint(self.learner)
        if key in revoked:
            return (f"the run owner revoked learner key {key[:16]}... for run '{self.run_id}'; this learner may no longer "
                    "train it: ask the owner (`swarm authorize`) whether it should, and for a new key's certificate")
        now = time.time() if now is None else now
        if now > self.expires:
            return (f"the certificate of learner key {key[:16]}... for run '{self.run_id}' expired "
                    f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(self.expires))}; ask the run owner for a new one "
                    "(`swarm authorize --learner-key KEY --run-id RUN`) and pass it as --certificate")
        return ""


def key_fingerprint(subkey: bytes) -> str:
    """A learner key's short name in revocation lists: SHA-256 of its canonical text, in hex."""
    return hashlib.sha256(canonical_owner(subkey)).hexdigest()


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


def issue(owner_private_key, run_id: str, learner: bytes, now: float | None = None,
          days: float = CERTIFICATE_DAYS) -> Certificate:
    """The owner's certificate that `learner` (a public-key subkey) may train and publish run `run_id`
    for `days` days."""
    _public_key(learner)  # refuse to certify something that is not a key
    if not 0 < days <= MAX_CERTIFICATE_DAYS:
        raise ValueError(f"a certificate is valid for more than 0 and at most {MAX_CERTIFICATE_DAYS:.0f} days, not {days}")
    issued = round(time.time() if now is None else now, 3)
    body = json.dumps({"run_id": run_id, "learner": _b64(canonical_owner(learner)), "owner": _b64(owner_key(owner_private_key)),
                       "issued": issued, "expires": round(issued + days * 86400.0, 3)}, sort_keys=True, separators=(",", ":"))
    signature = owner_private_key.sign(body.encode())
    return parse(f"{_b64(body.encode())}.{_b64(signature)}")


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
        expires = body.get("expires")
    except (ValueError, KeyError, TypeError, binascii.Error, AttributeError) as exc:
        raise CertificateError(f"not a certificate: its body does not parse ({type(exc).__name__})") from exc
    if not isinstance(expires, (int, float)) or isinstance(expires, bool):
        raise CertificateError("the certificate has no expiry (made by an older `swarm authorize`); ask the run owner "
                               "for a new one")
    if not isinstance(run_id, str):
        raise CertificateError("not a certificate: its run id is not text")
    if not _public_key(owner).verify(body_bytes, signature):
        raise CertificateError("the certificate's signature is not its owner key's")
    try:
        learner, owner = canonical_owner(learner), canonical_owner(owner)
    except ValueError as exc:
        raise CertificateError(f"a key in the certificate is not a peer's public key: {exc}") from exc
    return Certificate(run_id, learner, owner, issued, token, float(expires))


def authorises(token: str, run_id: str, owners: frozenset[bytes] | set[bytes], learner: bytes, *,
               now: float | None = None, revoked: frozenset[str] | set[str] = frozenset()) -> bool:
    """Whether `token` is a valid certificate, signed by one of `owners`, for `learner` in `run_id`,
    unexpired at `now` (default: this clock) and not naming a key in `revoked` (fingerprints)."""
    try:
        cert = parse(token)
        same_learner = cert.learner == canonical_owner(learner)
    except (CertificateError, ValueError):
        return False
    return cert.run_id == run_id and cert.owner in owners and same_learner and not cert.problem(now, revoked)


@dataclass(frozen=True)
class Revocations:
    """The run owner's list of learner keys it took back (fingerprints, key_fingerprint)."""

    run_id: str
    owner: bytes
    revoked: frozenset[str]
    issued: float
    token: str


def revoke(owner_private_key, run_id: str, learners, previous: Revocations | None = None, now: float | None = None) -> Revocations:
    """A revocation list naming `learners` (public-key subkeys) besides those `previous` named."""
    owner = owner_key(owner_private_key)
    if previous is not None and (previous.owner != owner or previous.run_id != run_id):
        raise CertificateError("the previous revocation list is another owner's or another run's")
    revoked = set(previous.revoked if previous is not None else ()) | {key_fingerprint(k) for k in learners}
    if len(revoked) > MAX_REVOKED:
        raise CertificateError(f"a revocation list names at most {MAX_REVOKED} keys; start the run under a new owner key")
    body = json.dumps({"run_id": run_id, "owner": _b64(owner), "revoked": sorted(revoked),
                       "issued": round(time.time() if now is None else now, 3)}, sort_keys=True, separators=(",", ":"))
    return parse_revocations(f"{_b64(body.encode())}.{_b64(owner_private_key.sign(body.encode()))}")


@lru_cache(maxsize=64)
def parse_revocations(token: str) -> Revocations:
    """The revocation list in `token`, its signature checked against the owner key it names.
    Raises CertificateError."""
    if not isinstance(token, str) or len(token) > MAX_REVOCATION_CHARS or token.count(".") != 1:
        raise CertificateError("not a revocation list: expected BODY.SIGNATURE as `swarm authorize --revoke` writes it")
    body_text, signature_text = token.split(".")
    try:
        body_bytes, signature = _unb64(body_text), _unb64(signature_text)
        body = json.loads(body_bytes)
        run_id, owner, revoked, issued = body["run_id"], _unb64(body["owner"]), body["revoked"], float(body["issued"])
    except (ValueError, KeyError, TypeError, binascii.Error, AttributeError) as exc:
        raise CertificateError(f"not a revocation list: its body does not parse ({type(exc).__name__})") from exc
    if not isinstance(run_id, str) or not isinstance(revoked, list) or len(revoked) > MAX_REVOKED or \
            not all(isinstance(k, str) and len(k) == 64 for k in revoked):
        raise CertificateError("not a revocation list: its run id or keys are malformed")
    if not _public_key(owner).verify(body_bytes, signature):
        raise CertificateError("the revocation list's signature is not its owner key's")
    return Revocations(run_id, canonical_owner(owner), frozenset(revoked), issued, token)


def read_certificate(value: str) -> str:
    """A certificate given on the command line: the token itself, or a file holding it."""
    text = value.strip()
    try:
        if Path(text).is_file():
            text = Path(text).read_text().strip()
    except OSError:  # a token is longer than a file name may be
        pass
    problem = parse(text).problem()  # a bad or expired one fails at start-up, with its reason
    if problem:
        raise CertificateError(problem)
    return text
