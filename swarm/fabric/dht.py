"""Start a hivemind DHT node for a run, with the swarm's record validators installed."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from swarm.fabric.interface import JoinError


def listen_maddrs(host: str, port: int) -> list[str]:
    """TCP multiaddrs to listen on: an IPv4 or IPv6 literal host, port 0 meaning any free port."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be 0..65535, got {port}")
    family = "ip6" if ":" in host else "ip4"
    return [f"/{family}/{host}/tcp/{port}"]


def start_dht(
    run_id: str,
    *,
    initial_peers: Sequence[str] = (),
    host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
    identity_path: Path | None = None,
    signing_key=None,
    startup_timeout: float = 30.0,
):
    """A running `hivemind.DHT` (in its own process) and its RSASignatureValidator.

    identity_path: libp2p key file (created if missing) for a stable peer id.
    signing_key: RSAPrivateKey for this peer's records (a fresh one if None).
    Raises JoinError naming the addresses when none of `initial_peers` answers in time.
    """
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.schema import SchemaValidator

    from swarm.fabric.records import make_schema

    for addr in initial_peers:
        if not str(addr).startswith("/"):
            raise ValueError(f"peer address {addr!r} is not a multiaddr; pass one like /ip4/1.2.3.4/tcp/31337/p2p/Qm...")
    from hivemind.utils.crypto import RSAPrivateKey

    # A fresh key rather than hivemind's process-wide default: two nodes in one process (tests,
    # a demo) must not be able to sign each other's records.
    signature = RSASignatureValidator(signing_key or RSAPrivateKey())
    validators = [SchemaValidator(make_schema(run_id), allow_extra_keys=True, prefix=run_id), signature]
    kwargs = dict(host_maddrs=list(host_maddrs), startup_timeout=startup_timeout)
    if identity_path is not None:
        Path(identity_path).parent.mkdir(parents=True, exist_ok=True)
        kwargs["identity_path"] = str(identity_path)
    try:
        dht = hivemind.DHT(initial_peers=list(initial_peers), start=True, record_validators=validators, **kwargs)
    except Exception as exc:  # noqa: BLE001  hivemind raises bare RuntimeErrors/P2PDaemonErrors
        if initial_peers:
            raise JoinError(
                f"could not join the swarm through {', '.join(initial_peers)}: {exc}. "
                "Check that the address is right and the bootstrap node is running and reachable"
            ) from exc
        # alone, the node can only fail to start: most often its port is taken
        raise OSError(f"could not start a DHT node listening on {', '.join(host_maddrs)}: {exc}. "
                      "Is the port in use? Choose another --port, or 0 for any free one") from exc
    return dht, signature


__all__ = ["JoinError", "listen_maddrs", "start_dht"]
