"""Is a port that a command was told to listen on free? Asked before a peer starts anything, so a
taken port is a one-line error at once, naming the option that chose it, rather than whatever the
listener says later: p2pd and gRPC listen with SO_REUSEPORT, so a second node on a taken port used to
start anyway beside the first (two daemons on one address, sharing a key), or fail after its join
timeout blaming the bootstrap node; a dashboard said only "[Errno 98] Address already in use".

A plain socket without SO_REUSEPORT cannot bind where any socket listens (with or without it), and
with SO_REUSEADDR it ignores connections of an earlier run still in TIME_WAIT, so the probe fails
exactly when the port is held by a listener. (Another process may still take the port between the
probe and the listen: the listener's own error is then caught and reported the same way, where the
code that listens can name the option.)"""

from __future__ import annotations

import errno
import socket


class PortTaken(OSError):
    """A port to listen on is taken; the message names the option and what to do."""

    def __init__(self, option: str, host: str, port: int) -> None:
        super().__init__(errno.EADDRINUSE, f"{option} {port}: the port is taken on {host} (another process listens there); "
                                           f"stop that process, or choose another {option} (0: any free port)")
        self.option, self.host, self.port = option, host, port

    def __str__(self) -> str:
        return self.strerror


def check_port_free(host: str, port: int | None, option: str) -> None:
    """Raise PortTaken when `port` (0 or None: any free one, never taken) on `host` has a listener.
    Other bind failures (an address that is not this machine's) are left to the listener to report."""
    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortTaken(option, host, port) from None


def check_config_ports(config) -> None:
    """Check the listening ports a role's config sets: `port` on `host` (--port) and, where the
    role serves a dashboard, `dashboard_port` on `dashboard_host` (--dashboard-port)."""
    for port_field, host_field in (("port", "host"), ("dashboard_port", "dashboard_host")):
        port = getattr(config, port_field, None)
        if port:
            check_port_free(str(getattr(config, host_field)), int(port), f"--{port_field.replace('_', '-')}")
