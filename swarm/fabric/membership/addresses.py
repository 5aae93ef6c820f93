"""Which of this machine's addresses to tell other peers, and in which order.

A peer listening on every interface (0.0.0.0, the default) is reachable at several addresses:
loopback, a LAN address, perhaps a public one. Others should be given the one they can dial
first: an address the operator announced, then public addresses, then private ones, and loopback
last (it only works on this machine).
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Iterable, Sequence

from swarm.config import split_host_port


def ip_rank(ip: str) -> int:
    """0 for a public address, 1 private (LAN, carrier NAT), 2 link-local, 3 loopback, 4 anything
    unreadable: the order in which to offer addresses to other peers."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return 4
    if addr.is_loopback:
        return 3
    if addr.is_link_local:
        return 2
    if addr.is_private or addr in ipaddress.ip_network("100.64.0.0/10"):
        return 1
    return 0


def maddr_ip(maddr: str) -> str:
    """The IP of a multiaddr (`/ip4/1.2.3.4/tcp/...`), "" when it has none."""
    parts = str(maddr).split("/")
    return parts[2] if len(parts) > 2 and parts[1] in ("ip4", "ip6") else ""


def order_for_others(maddrs: Iterable[str], announced: Iterable[str] = ()) -> list[str]:
    """`maddrs` with the announced ones first, then by ip_rank (stable within a rank), without duplicates."""
    announced = [str(a) for a in announced]
    rest = sorted((str(m) for m in maddrs if str(m) not in announced), key=lambda m: ip_rank(maddr_ip(m)))
    return list(dict.fromkeys(announced + rest))


def interface_addresses() -> list[str]:
    """This machine's IPv4 addresses, best for others first (loopback last)."""
    import psutil

    found = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET]
    return sorted(dict.fromkeys(found), key=ip_rank)


def outbound_address() -> str | None:
    """The source address this machine uses for the default route (no packet is sent: connecting a
    UDP socket only picks a route); None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere real
            return probe.getsockname()[0]
        except OSError:
            return None


def is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def usable_ip(ip) -> str | None:
    """`ip` as others could dial it (an IPv4-mapped IPv6 address as IPv4), or None when it is not an
    address or is loopback (a registry on the same machine says nothing about what others can dial)."""
    try:
        addr = ipaddress.ip_address(ip)
    except (TypeError, ValueError):
        return None
    addr = getattr(addr, "ipv4_mapped", None) or addr
    return None if addr.is_loopback or addr.is_unspecified else str(addr)


def host_port(host: str, port: int) -> str:
    """HOST:PORT, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def announced_address(announce_addr: str, port: int) -> str:
    """HOST:PORT of an --announce-addr (HOST or HOST:PORT), the listening `port` where it names none."""

    host, announced_port = split_host_port(announce_addr)
    return host_port(host, announced_port or port)


def refuses_connections(host: str, port: int, timeout_s: float = 3.0) -> bool:
    """True when HOST:PORT answers a TCP connection with a refusal (nothing listens there): a join
    through it cannot work, and saying so at once beats a transport's retries until its timeout.
    Anything else (it accepts, drops packets, has no route) is False: the transport decides."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def dial_address(peer: str) -> str:
    """Where to reach a gRPC peer: the address part of a peer id (`KEYID@host:port`), or `host:port`
    itself (the registry's address has no key id)."""
    return peer.partition("@")[2] if "@" in peer else peer


def refused_join(transport: str, peers: Sequence[str], timeout_s: float = 3.0) -> str | None:
    """Why a join through `peers` cannot work when every one of them refuses a TCP connection
    (nothing listens there), found in a moment; None when any might answer, or names no TCP port
    (a DNS name, QUIC, a relay): the transport decides. gRPC joins through its registry, peers[0]."""
    if not peers:
        return None
    if transport == "grpc":
        host, port = split_host_port(dial_address(peers[0]))
        if port is not None and refuses_connections(host, port, timeout_s):
            return (f"could not join the swarm through the registry at {peers[0]}: connection refused (nothing listens "
                    "there). Check the address and port, and that `swarm bootstrap --transport grpc` runs there")
        return None
    endpoints = [maddr_tcp(addr) for addr in peers]
    if all(endpoints) and all(refuses_connections(*e, timeout_s) for e in endpoints):
        return (f"could not join the swarm through {', '.join(peers)}: connection refused (nothing listens there). "
                "Check the address and port, and that the bootstrap node or peer is running")
    return None


def check_reachable(transport: str, peers: Sequence[str]) -> None:
    """Raise ConnectionRefusedError, naming the addresses, when every one of `peers` refuses a
    connection. A learner and a sampler check once their input is known good, before they load their
    model, and `swarm status` and `swarm dashboard` before they import torch: a wrong port, or a
    bootstrap node not started yet, then fails at once rather than after the model has loaded (minutes
    at real scale). What might answer is left to the join."""
    # (a refusal comes back within a round trip; an address that drops packets is the join's to wait for)
    refused = refused_join(transport, peers, timeout_s=1.0)
    if refused:
        raise ConnectionRefusedError(refused)


def maddr_tcp(maddr: str) -> tuple[str, int] | None:
    """(ip, port) of a `/ip4|ip6/IP/tcp/PORT/...` multiaddr; None for any other kind (DNS names,
    QUIC, relays), which are left for libp2p to dial."""
    parts = str(maddr).split("/")
    if len(parts) > 4 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp" and parts[4].isdigit():
        return parts[2], int(parts[4])
    return None
