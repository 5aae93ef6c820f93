"""The one place a transport is chosen. Everything else asks this module for a fabric (a joined
peer), an observer (reads the swarm without joining it) or a bootstrap node, by transport name.

- hivemind: a DHT for records, libp2p streams for rollouts and weights (hivemind/fabric.py);
- grpc: the fallback where libp2p cannot run; a registry for records, gRPC streams between peers
  (grpc/registry.py, grpc/fabric.py).

Which addresses fit which transport is checked with the settings (swarm.config.check_peers), so a
bad --peers is a usage error before anything starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from swarm.config import BootstrapConfig, SwarmSettings, check_bootstrap_peers, check_peers, default_of
from swarm.fabric.interface import BootstrapNode, Fabric
from swarm.fabric.membership.identity import claim_identity_slot, identity_dir_or_default, load_or_create_signing_key


def join(transport: str, *, run_id: str, peers: Sequence[str], role: str, identity_dir: Path | None = None,
         host: str = "127.0.0.1", port: int = 0, heartbeat_s: float = default_of(SwarmSettings, "heartbeat_s"),
         announce_addr: str | None = None, auto_relay: bool = False, client_mode: bool = False,
         upload_slots: int | None = None, insecure: bool = False) -> Fabric:
    """Join the swarm as a peer that serves (rollouts, weights) on `host:port`.

    identity_dir: where this peer's persistent keys live (a free key slot for `role` is claimed, so
    two peers started from one directory never share an identity); None: fresh keys, kept nowhere.
    announce_addr: the address others are told to dial (SwarmSettings.announce_addr); auto_relay,
    client_mode: hivemind's options for a peer behind a NAT (see SwarmSettings).
    upload_slots: how many weight transfers this peer serves at once (None: no limit); a requester
    over the limit is told the holder is busy and asks another. insecure: gRPC without TLS.
    """
    from hivemind.utils.crypto import RSAPrivateKey

    check_peers(transport, peers)
    p2p_key = key_path = None
    if identity_dir is None:
        signing_key = RSAPrivateKey()
    else:
        # absolute: the p2p daemon is told this path, and leftover daemons are found by it
        identity_dir = Path(identity_dir).resolve()
        stem = claim_identity_slot(identity_dir, role)
        key_path = identity_dir / f"{stem}.sign.key"
        signing_key = load_or_create_signing_key(key_path)
        p2p_key = identity_dir / f"{stem}.p2p.key"
    if transport == "grpc":
        from swarm.fabric.grpc.fabric import GrpcFabric

        fabric = GrpcFabric(peers[0], run_id, signing_key, host=host, port=port, heartbeat_s=heartbeat_s,
                            announce_addr=announce_addr, upload_slots=upload_slots, insecure=insecure)
        fabric.signing_key_path = key_path  # the run owner's key file, for `swarm authorize`
        return fabric
    from swarm.fabric.hivemind.dht import announce_multiaddrs, listen_maddrs, start_dht
    from swarm.fabric.hivemind.fabric import HivemindFabric

    port, announced = announce_multiaddrs(announce_addr, port)
    dht, validator = start_dht(run_id, initial_peers=list(peers), host_maddrs=listen_maddrs(host, port),
                               announce_maddrs=announced, use_auto_relay=auto_relay, client_mode=client_mode,
                               identity_path=p2p_key, reclaim_identity=p2p_key is not None, signing_key=signing_key)
    fabric = HivemindFabric(dht, validator, run_id, heartbeat_s=heartbeat_s, announced=announced, upload_slots=upload_slots,
                            client_mode=client_mode, signing_key=signing_key)
    fabric.signing_key_path = key_path
    return fabric


def join_with(settings: SwarmSettings, role: str) -> Fabric:
    """`join` with a role config's swarm settings (every peer joins the same way)."""

    return join(settings.transport, run_id=settings.run_id, peers=settings.peers, role=role,
                identity_dir=identity_dir_or_default(settings.identity_dir), host=settings.host, port=settings.port,
                heartbeat_s=settings.heartbeat_s, announce_addr=settings.announce_addr, auto_relay=settings.auto_relay,
                client_mode=settings.client_mode, upload_slots=settings.upload_slots or None, insecure=settings.insecure)


def observe(transport: str, *, run_id: str, peers: Sequence[str], insecure: bool = False) -> Fabric:
    """A fabric that reads the swarm (members, announcements) without taking part: it heartbeats
    nothing and serves no rollouts or weights (over hivemind it is still a DHT node, which stores
    and serves records as every DHT node does)."""
    check_peers(transport, peers)
    if transport == "grpc":
        from hivemind.utils.crypto import RSAPrivateKey

        from swarm.fabric.grpc.fabric import GrpcFabric

        return GrpcFabric(peers[0], run_id, RSAPrivateKey(), serve=False, heartbeat_s=default_of(SwarmSettings, "heartbeat_s"),
                          insecure=insecure)
    from swarm.fabric.hivemind.dht import start_dht
    from swarm.fabric.hivemind.fabric import HivemindFabric

    # a client-mode node: an observer that comes and goes should not enter others' routing tables
    return HivemindFabric(*start_dht(run_id, initial_peers=list(peers), client_mode=True), run_id,
                          heartbeat_s=default_of(SwarmSettings, "heartbeat_s"))


def start_bootstrap(transport: str, *, run_id: str, host: str, port: int, identity_path: Path | None = None,
                    initial_peers: Sequence[str] = (), announce_addr: str | None = None, insecure: bool = False,
                    max_runs_per_owner: int = default_of(BootstrapConfig, "max_runs_per_owner")) -> BootstrapNode:
    """The node peers join through: a DHT node (hivemind) or the registry (grpc). A registry's TLS
    key lives beside `identity_path` (`*.sign.key`), so its KEYID@HOST:PORT survives restarts."""
    check_bootstrap_peers(transport, initial_peers)
    if transport == "grpc":
        from swarm.fabric.grpc.registry import GrpcBootstrap

        key = load_or_create_signing_key(Path(identity_path).with_suffix(".sign.key")) if identity_path else None
        return GrpcBootstrap(run_id, host=host, port=port, announce_addr=announce_addr, signing_key=key, insecure=insecure,
                             max_runs_per_owner=max_runs_per_owner)
    from swarm.fabric.hivemind.fabric import HivemindBootstrap

    return HivemindBootstrap(run_id, host=host, port=port, identity_path=identity_path, initial_peers=initial_peers,
                             announce_addr=announce_addr)
