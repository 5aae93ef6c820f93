"""TLS for the gRPC transport, pinned by key rather than by a certificate authority.

Each server presents a self-signed X.509 certificate made at start-up from its own signing key (the
RSA key whose id is in its peer id, `KEYID@host:port`). A client that dials a peer id reads the
certificate the server presents, checks that its public key has the id the peer id names, and only
then opens a gRPC channel that trusts exactly that certificate: the TLS handshake then proves that
the server holds the key's private half, so a man in the middle can neither read nor rewrite
anything, and a server with another key is refused before a byte of a request is sent. The
registry's address is given as `KEYID@host:port` too (as `swarm bootstrap --transport grpc` prints
it); a bare `host:port` is trusted on first use, with a warning.

Request signatures (grpc/common.py) still name the caller: TLS here authenticates the server only.
`insecure=True` (`--insecure`) turns TLS off on both sides, with a warning: plain-text peers and TLS
peers cannot talk to each other.
"""

from __future__ import annotations

import datetime
import logging
import socket
import ssl
from dataclasses import dataclass

import grpc

from swarm.fabric.signing import id_of_public_key

logger = logging.getLogger(__name__)

# A key's certificate is the same bytes every time it is made (fixed dates and serial, and PKCS#1
# v1.5 signatures are deterministic): a peer that restarts with its key presents the certificate
# its peers' channels pinned before. Its dates only have to be valid; the key is what is checked.
VALID_FROM = datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc)
VALID_UNTIL = datetime.datetime(2124, 1, 1, tzinfo=datetime.timezone.utc)
HANDSHAKE_TIMEOUT_S = 5.0  # reading a new peer's certificate: a TCP connect and one TLS handshake
INSECURE_WARNING = ("TLS is off (--insecure): everything this peer sends and receives over gRPC can be read and "
                    "rewritten on the way; use it only on a network you trust, and with peers that run --insecure too")


class WrongPeerKey(ConnectionError):
    """The server at an address presented a certificate whose key is not the one its peer id names."""


@dataclass(frozen=True)
class ServerIdentity:
    """A server's TLS key and certificate (PEM), made from its signing key."""

    key_pem: bytes
    certificate_pem: bytes
    key_id: str

    def credentials(self):
        return grpc.ssl_server_credentials([(self.key_pem, self.certificate_pem)])


def server_identity(signing_key) -> ServerIdentity:
    """The self-signed certificate of `signing_key` (hivemind's RSAPrivateKey): subject and DNS name
    are the key's id, which a client names when it checks the certificate; the same bytes for the
    same key, every time."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    private = signing_key._private_key
    name = id_of_public_key(private.public_key())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    certificate = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(private.public_key())
                   .serial_number(int(name, 16) | 1)  # positive, nonzero, fixed per key
                   .not_valid_before(VALID_FROM).not_valid_after(VALID_UNTIL)
                   .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .sign(private, hashes.SHA256()))
    key_pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                    serialization.NoEncryption())
    return ServerIdentity(key_pem, certificate.public_bytes(serialization.Encoding.PEM), name)


def presented_certificate(address: str, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> bytes:
    """The certificate (PEM) the TLS server at `host:port` presents, read without trusting it: it is
    only a candidate, checked against the key id the caller expects, and then pinned. Raises
    ConnectionError naming the address when nothing answers TLS there."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # checked by key id below, not by a CA
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            with context.wrap_socket(sock, server_hostname=None) as tls:
                der = tls.getpeercert(binary_form=True)
    except ssl.SSLError as exc:
        raise ConnectionError(f"the gRPC peer at {address} does not speak TLS ({exc.reason}); if it runs with --insecure, "
                              "so must this one") from None
    except (OSError, ValueError) as exc:
        raise ConnectionError(f"could not reach the gRPC peer at {address} for its certificate: {exc}") from None
    if not der:
        raise ConnectionError(f"the gRPC peer at {address} presented no certificate")
    return ssl.DER_cert_to_PEM_cert(der).encode()


def certificate_key_id(certificate_pem: bytes) -> str:
    """The id of the public key in a certificate (as signing.owner_id names keys)."""
    from cryptography import x509

    return id_of_public_key(x509.load_pem_x509_certificate(certificate_pem).public_key())


def pinned_channel(address: str, expected_key: str, options: list, timeout_s: float = HANDSHAKE_TIMEOUT_S):
    """A TLS channel to `address` that trusts only the certificate of the key `expected_key` names
    ("" for an address given without a key id: the certificate presented now is trusted, on first
    use, and pinned for the channel's life). Raises WrongPeerKey when the server's key is another."""
    certificate = presented_certificate(address, timeout_s)
    found = certificate_key_id(certificate)
    if expected_key and found != expected_key:
        raise WrongPeerKey(f"the gRPC peer at {address} holds key {found}, not {expected_key} as its peer id says: "
                           "refused (someone else answers at that address, or the address is stale)")
    if not expected_key:
        logger.warning("trusting the key %s that %s presents on first use: pass %s@%s to pin it", found, address, found, address)
    credentials = grpc.ssl_channel_credentials(root_certificates=certificate)
    return grpc.secure_channel(address, credentials, options=options + [("grpc.ssl_target_name_override", found)])
