"""A small WAN on one Linux box: processes in network namespaces joined by shaped links and NAT routers,
so tests and benchmarks can run a swarm "across machines" without any.

    with Wan() as wan:
        a = wan.host("a", rate_mbit=8)            # public host, 8 Mbit/s up and 8 Mbit/s down
        home = wan.nat("home", rate_mbit=20)      # router: public leg + LAN behind MASQUERADE
        b = wan.behind(home, "b")                 # 192.168.77.2, reaches the internet via home
        p = b.popen(python_argv("-m", "swarm.cli", ...))

Topology. The "internet" is a bridge inside a core namespace the harness creates (never the root
namespace); every public host and every router's public leg is a veth port on it, with an address on
10.207.0.0/16. A router's LAN is a second bridge inside the router's namespace; hosts behind it get
addresses on its LAN subnet (192.168.77.0/24 by default; two routers may share one, as two homes do)
and a default route via the router. No namespace has a route to the machine's real network: the
harness only ever creates links between namespaces it made, so no traffic leaves them.

NAT. A router MASQUERADEs LAN -> internet and drops new connections from the internet to its LAN
(only ESTABLISHED/RELATED are forwarded inwards), so even a public host that adds a route to the
LAN cannot reach a NATed host: the NAT behaves as a home router without port forwarding.

Shaping. `rate_mbit` puts a tbf on both ends of a host's veth (upload and download). The kernel here
has no `netem`, so there is NO latency or loss emulation: links add only the queueing delay of a
loaded tbf (at most `_QUEUE_S`). Results that depend on round-trip time are out of this harness's
reach; bandwidth-bound ones are not.

Only networking is isolated: processes share the filesystem, users and hostname with the machine,
so give each host its own working directory and Unix-socket paths. IPv6 link-local addresses are not
generated on the harness's links (loopback keeps ::1), so the hosts talk IPv4.

Cleanup. close() (also run by `with`, by atexit, and safe to call twice) SIGTERMs the process group
of every process started with popen() and every other process still inside the harness's namespaces,
SIGKILLs what remains after a grace period, then deletes the namespaces (which deletes the veths).
Processes are found by pid, process group or namespace, never by name. Namespace names carry the
owner's pid (`gw<pid>x<n>-<host>`), so sweep_stale() can remove leftovers of a run that was killed
(it judges owners by pid, so it assumes every harness user shares this machine's PID namespace).
Needs root, `ip` and `tc` (iproute2); NAT also needs `iptables`. wan_unavailable() says why not.
"""

from __future__ import annotations

import atexit
import functools
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time

# private, and unlikely to clash with anything (it never leaves the namespaces anyway)
INTERNET = ipaddress.ip_network("10.207.0.0/16")
# tbf queue beyond the burst, in seconds at the link's rate: enough for a TCP flow to keep the link busy
# through the drops that pace it, short enough not to add much bufferbloat
_QUEUE_S = 0.05
# tbf bucket, in seconds at the rate (at least _MIN_BURST): small, so nothing runs much faster than the rate
_BURST_S = 0.01
_MIN_BURST = 16 * 1024  # above the MTU and the kernel's timer granularity at low rates
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}\Z")
_OWNED = re.compile(r"gw(\d+)x\d+-")  # the default prefix: owner pid, Wan counter
_counter = itertools.count()
_live: set[Wan] = set()  # strong references: a Wan dropped without close() is still closed at exit


class WanError(RuntimeError):
    pass


def _sh(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise WanError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def python_argv(*args: str) -> list[str]:
    """This interpreter (the venv's) with `args`: `host.popen(python_argv("-m", "swarm.cli", ...))`."""
    return [sys.executable, *args]


@functools.cache
def wan_unavailable(nat: bool = False) -> str | None:
    """None when this machine can build the harness (root, ip netns, tc tbf; with nat=True also
    iptables MASQUERADE and conntrack inside a namespace), else the reason. Probes by doing it once."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    tools = ["ip", "tc"] + (["iptables"] if nat else [])
    if missing := [t for t in tools if shutil.which(t) is None]:
        hint = " (apt-get install iptables)" if "iptables" in missing else ""
        return f"not installed: {', '.join(missing)}{hint}"
    ns = f"gw{os.getpid()}x{next(_counter)}-probe"
    try:
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _tbf(ns, "lo", 8)
        if nat:
            _sh("ip", "netns", "exec", ns, "sh", "-ec", "iptables -t nat -A POSTROUTING -o lo -j MASQUERADE; "
                "iptables -A FORWARD -m conntrack --ctstate ESTABLISHED -j ACCEPT")
    except (WanError, OSError, subprocess.SubprocessError) as e:
        return f"cannot build a namespace here: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    return None


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pids_in(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _signal(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


# torch's shared-memory managers (one beside each peer) exit by themselves 2 s after their last client and
# unlink their shared memory only then: killed, they leave it in /dev/shm (swarm.cli.launcher.exits_by_itself)
MANAGERS_EXIT_S = 5.0


def _delete(namespaces: list[str], grace_s: float = 0.0) -> None:
    """Empty the namespaces (processes in them die: TERM, then KILL after `grace_s`; torch's shared-memory
    managers are given MANAGERS_EXIT_S to exit by themselves once the rest is gone), then delete them."""
    def others(ns: str) -> list[int]:
        return [pid for pid in _pids_in(ns) if not _exits_by_itself(pid)]

    if grace_s:
        for ns in namespaces:
            _signal(others(ns), signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(others(ns) for ns in namespaces):
            time.sleep(0.05)
    for ns in namespaces:
        _signal(others(ns), signal.SIGKILL)
    deadline = time.monotonic() + MANAGERS_EXIT_S
    while time.monotonic() < deadline and any(_pids_in(ns) for ns in namespaces):
        time.sleep(0.05)
    for ns in namespaces:
        _signal(_pids_in(ns), signal.SIGKILL)
    for ns in namespaces:  # a namespace already gone is fine: the goal is that it does not exist
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _exits_by_itself(pid: int) -> bool:
    import psutil

    from swarm.cli.launcher import exits_by_itself

    try:
        return exits_by_itself(psutil.Process(pid))
    except psutil.Error:
        return False


def sweep_stale() -> list[str]:
    """Delete namespaces left by Wans whose owner process is dead (a run killed before close()).
    Only names of the default form `gw<pid>x<n>-...` are considered. Returns the names deleted."""
    stale = []
    for ns in _namespaces():
        if (m := _OWNED.match(ns)) is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            stale.append(ns)
        except PermissionError:
            pass  # alive, someone else's
    _delete(stale)
    return stale


def _tbf(ns: str, dev: str, rate_mbit: float) -> None:
    rate = rate_mbit * 1e6 / 8  # bytes/s
    burst = max(_MIN_BURST, int(rate * _BURST_S))
    limit = burst + int(rate * _QUEUE_S)
    _sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
        "rate", f"{round(rate_mbit * 1e6)}bit", "burst", str(burst), "limit", str(limit))


class Host:
    """One namespace. `ip` is its own address (private behind a NAT); `public_ip` is the address other
    hosts on the internet see it as (its router's for a NATed host)."""

    def __init__(self, wan: Wan, name: str, ns: str, ip: str, public_ip: str):
        self.wan, self.name, self.ns, self.ip, self.public_ip = wan, name, ns, ip, public_ip

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} ns={self.ns} ip={self.ip}>"

    def _argv(self, argv) -> list[str]:
        # `ip netns exec` setns()es and then execs argv: the process it returns IS argv (no wrapper)
        return ["ip", "netns", "exec", self.ns, *map(str, argv)]

    def popen(self, argv, *, env=None, stdout=None, stderr=None, cwd=None, **kw) -> subprocess.Popen:
        """Start argv inside the namespace, in its own session (process group = its pid), with the
        caller's environment unless `env` is given. The Wan kills its group at close(); to kill it
        earlier, use Popen.kill() or os.killpg(p.pid, sig)."""
        if self.wan.closed:
            raise WanError("the Wan is closed")
        env = os.environ.copy() if env is None else env
        p = subprocess.Popen(self._argv(argv), env=env, stdout=stdout, stderr=stderr, cwd=cwd,
                             start_new_session=True, **kw)
        self.wan._procs.append(p)
        return p

    def traffic(self, dev: str = "eth0") -> tuple[int, int]:
        """(bytes received, bytes sent) so far on the host's link (`eth0`: its only one, or a router's public leg)."""
        import json

        stats = json.loads(_sh("ip", "-n", self.ns, "-j", "-s", "link", "show", "dev", dev))[0]["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    def run(self, argv, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        """Run argv inside the namespace to completion; output captured as text unless told otherwise."""
        if not {"stdout", "stderr", "capture_output"} & kw.keys():
            kw["capture_output"] = True
        kw.setdefault("text", True)
        kw.setdefault("env", os.environ.copy())
        return subprocess.run(self._argv(argv), timeout=timeout, **kw)


class Router(Host):
    """A NAT router: `ip`/`public_ip` its internet address, `lan` its LAN subnet, `lan_ip` its LAN address.
    A Host too: popen()/run() work inside it (tcpdump on the NAT, a LAN-side probe)."""

    def __init__(self, wan: Wan, name: str, ns: str, ip: str, lan: ipaddress.IPv4Network):
        super().__init__(wan, name, ns, ip, ip)
        self.lan = lan
        self._free = iter(lan.hosts())
        self.lan_ip = str(next(self._free))
        self._taken = {self.lan_ip}


def forward_port(router: "Router", port: int, host: "Host") -> None:
    """Forward TCP `port` of `router`'s public address to the same port of `host` on its LAN (a
    volunteer's port forward). Inserted before the router's DROP of new inbound connections."""
    rules = [f"iptables -t nat -A PREROUTING -i eth0 -p tcp --dport {port} -j DNAT --to-destination {host.ip}:{port}",
             f"iptables -I FORWARD 1 -i eth0 -o lan -p tcp -d {host.ip} --dport {port} -j ACCEPT"]
    _sh("ip", "netns", "exec", router.ns, "sh", "-ec", "; ".join(rules))


class Wan:
    """The harness. A context manager: every namespace, link and process it made is gone after close().
    `prefix` starts every namespace name (default `gw<pid>x<n>`, which sweep_stale() recognises);
    `core` is the namespace holding the internet bridge."""

    def __init__(self, prefix: str | None = None):
        self.prefix = prefix or f"gw{os.getpid()}x{next(_counter)}"
        self.closed = False
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._hosts: dict[str, Host] = {}
        self._public = iter(INTERNET.hosts())
        self._ports = itertools.count()  # bridge-side veth names, p0, p1, ...: unique across the Wan
        self._public_ports: dict[str, str] = {}  # host or router name -> its public leg's port on the internet bridge
        _live.add(self)
        try:
            self.core = self._netns("internet")  # the one name host() and nat() refuse
            _sh("ip", "-n", self.core, "link", "add", "inet", "type", "bridge")
            self._up(self.core, "inet")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Wan:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # building blocks

    def _check(self, name: str) -> None:
        if not _NAME.match(name) or name in self._hosts or name == "internet":
            raise ValueError(f"bad or duplicate host name {name!r}")

    def _netns(self, name: str) -> str:
        ns = f"{self.prefix}-{name}"
        _sh("ip", "netns", "add", ns)
        self._namespaces.append(ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")  # peers talk to themselves over 127.0.0.1
        return ns

    @staticmethod
    def _up(ns: str, dev: str, master: str | None = None) -> None:
        # no IPv6 link-local on harness links: peers should not discover addresses the WAN does not route
        _sh("ip", "-n", ns, "link", "set", "dev", dev, "addrgenmode", "none")
        _sh("ip", "-n", ns, "link", "set", "dev", dev, "up", *(["master", master] if master else []))

    def _wire(self, ns: str, dev: str, switch_ns: str, bridge: str, rate_mbit: float | None,
              up_mbit: float | None = None) -> str:
        """A veth from `ns` (named `dev` there) to a port of `bridge` in `switch_ns`, shaped both ways
        (upload to `up_mbit` when given); returns the port's name. Both ends are created directly
        inside their namespaces, so nothing appears in the root one."""
        port = f"p{next(self._ports)}"
        _sh("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", switch_ns)
        self._up(switch_ns, port, master=bridge)
        self._up(ns, dev)
        if up_mbit or rate_mbit is not None:
            _tbf(ns, dev, up_mbit or rate_mbit)  # upload
        if rate_mbit is not None:
            _tbf(switch_ns, port, rate_mbit)  # download
        return port

    def _public_leg(self, name: str, rate_mbit: float | None, up_mbit: float | None = None) -> tuple[str, str]:
        self._check(name)
        ns = self._netns(name)
        ip = str(next(self._public))
        self._public_ports[name] = self._wire(ns, "eth0", self.core, "inet", rate_mbit, up_mbit)
        _sh("ip", "-n", ns, "addr", "add", f"{ip}/{INTERNET.prefixlen}", "dev", "eth0")
        return ns, ip

    # the API

    def hosts(self) -> list[Host]:
        """Every host and router made so far."""
        return list(self._hosts.values())

    def host(self, name: str, *, rate_mbit: float | None = None, up_mbit: float | None = None) -> Host:
        """A namespace on the internet with its own public address, its link shaped to `rate_mbit` both
        ways (unshaped when None), its upload to `up_mbit` when given (an asymmetric line: a fast
        download behind a slow upload). It has no default route: only the harness's internet exists."""
        ns, ip = self._public_leg(name, rate_mbit, up_mbit)
        host = self._hosts[name] = Host(self, name, ns, ip, ip)
        return host

    def shape(self, name: str, rate_mbit: float, *, download: bool = True, upload: bool = True) -> None:
        """Reshapes host `name`'s link to `rate_mbit` both ways (`download` or `upload` False: the
        other alone), while its peers run (a link that turns slow after the peers joined: the
        benchmark picks which one once it knows their ids)."""
        if upload:
            _tbf(self._hosts[name].ns, "eth0", rate_mbit)
        if download:
            _tbf(self.core, self._public_ports[name], rate_mbit)

    def public_traffic(self) -> dict[str, tuple[int, int]]:
        """(bytes uploaded, bytes downloaded) so far by every host and router on the internet, read
        from the bridge's ports in one call (Host.traffic costs a call per host)."""
        import json

        stats = {link["ifname"]: link["stats64"] for link in json.loads(_sh("ip", "-n", self.core, "-j", "-s", "link", "show"))}
        # a port receives what its host sends
        return {name: (stats[port]["rx"]["bytes"], stats[port]["tx"]["bytes"]) for name, port in self._public_ports.items()
                if port in stats}

    def nat(self, name: str, *, rate_mbit: float | None = None, lan: str = "192.168.77.0/24") -> Router:
        """A router: a public leg like host()'s (uplink shaped to `rate_mbit`), a LAN bridge with the
        subnet's first address, MASQUERADE for LAN -> internet, nothing forwarded from the internet
        to the LAN unless it answers a connection the LAN opened."""
        net = ipaddress.ip_network(lan)
        if not net.is_private or net.overlaps(INTERNET):
            raise ValueError(f"LAN {lan} must be private and outside {INTERNET}")
        ns, ip = self._public_leg(name, rate_mbit)
        router = Router(self, name, ns, ip, net)
        self._hosts[name] = router
        _sh("ip", "-n", ns, "link", "add", "lan", "type", "bridge")
        self._up(ns, "lan")
        _sh("ip", "-n", ns, "addr", "add", f"{router.lan_ip}/{net.prefixlen}", "dev", "lan")
        # the namespace's own ip_forward (sysctls under net/ are per namespace); one exec for all the rules
        rules = [
            "echo 1 > /proc/sys/net/ipv4/ip_forward",
            f"iptables -t nat -A POSTROUTING -s {net} -o eth0 -j MASQUERADE",
            "iptables -A FORWARD -i eth0 -o lan -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
            "iptables -A FORWARD -i eth0 -o lan -j DROP",
        ]
        _sh("ip", "netns", "exec", ns, "sh", "-ec", "; ".join(rules))
        return router

    def behind(self, router: Router, name: str, *, ip: str | None = None, rate_mbit: float | None = None) -> Host:
        """A namespace on `router`'s LAN with address `ip` (else the next free one) and a default route
        via the router; its link to the LAN is shaped to `rate_mbit` both ways when given."""
        self._check(name)
        lan = router.lan
        if ip is None:
            ip = next((a for a in map(str, router._free) if a not in router._taken), None)
            if ip is None:
                raise ValueError(f"{router.lan} is full")
        elif ip in router._taken or not lan.network_address < ipaddress.ip_address(ip) < lan.broadcast_address:
            raise ValueError(f"{ip} is taken or not a host address of {router.lan}")
        ns = self._netns(name)
        router._taken.add(ip)
        self._wire(ns, "eth0", router.ns, "lan", rate_mbit)
        _sh("ip", "-n", ns, "addr", "add", f"{ip}/{router.lan.prefixlen}", "dev", "eth0")
        _sh("ip", "-n", ns, "route", "add", "default", "via", router.lan_ip)
        host = self._hosts[name] = Host(self, name, ns, ip, router.ip)
        return host

    def close(self, grace_s: float = 2.0) -> None:
        """Stop every process (TERM to each popen'd process group and to anything else inside our
        namespaces, KILL after `grace_s`), then delete the namespaces. Idempotent; never raises for
        things already gone."""
        if self.closed:
            return
        self.closed = True
        _live.discard(self)
        # a leader not yet reaped still pins its pid, so its group id cannot belong to anyone else
        running = [p for p in self._procs if p.poll() is None]
        for p in running:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace_s
        for p in running:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        # what escaped its group (setsid children, ...) is still in one of our namespaces
        _delete(self._namespaces, grace_s=max(0.0, deadline - time.monotonic()) or 0.2)
        for p in self._procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass


@atexit.register
def _close_all() -> None:
    for wan in list(_live):
        wan.close()
