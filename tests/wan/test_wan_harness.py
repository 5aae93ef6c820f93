"""The WAN harness (benchmarks/wan.py): real processes in network namespaces, shaped links, NAT.
Needs root, iproute2 and (for the NAT tests) iptables; skipped with the reason elsewhere."""

from __future__ import annotations

import ipaddress
import os
import subprocess

import pytest

from benchmarks.wan import Wan, python_argv, sweep_stale, wan_unavailable

if (_reason := wan_unavailable()) is not None:
    pytest.skip(f"WAN harness unavailable: {_reason}", allow_module_level=True)

pytestmark = pytest.mark.timeout(60)
needs_nat = pytest.mark.skipif(wan_unavailable(nat=True) is not None,
                               reason=f"NAT unavailable: {wan_unavailable(nat=True)}")


@pytest.fixture(scope="module", autouse=True)
def _no_leftovers():
    sweep_stale()  # namespaces of an earlier run that was killed before it could close its Wans


PORT = 9000  # ports are per namespace: no clash with anything else on the machine

# Tiny programs run inside the namespaces. A client retries a refused connection (the server may not
# listen yet) but not an unreachable network or a timeout: those are the answers the tests look for.
CONNECT = """
import socket, sys, time
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + timeout
while True:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        print("ok"); break
    except ConnectionRefusedError:
        if time.monotonic() > deadline: print("ConnectionRefusedError"); sys.exit(1)
        time.sleep(0.05)
    except OSError as e:
        print(type(e).__name__); sys.exit(1)
"""
ACCEPT = """
import signal, socket, sys
signal.alarm(20)
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen()
for _ in range(int(sys.argv[2])):
    conn, (peer, _port) = s.accept(); print(peer, flush=True); conn.close()
"""
SINK = """
import signal, socket, sys, time
signal.alarm(30)
s = socket.socket(); s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen()
conn, _ = s.accept(); t0 = time.monotonic(); n = 0
while chunk := conn.recv(1 << 16):
    n += len(chunk)
print(n, time.monotonic() - t0)
"""
SOURCE = """
import socket, sys, time
host, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
deadline = time.monotonic() + 10
while True:
    try:
        c = socket.create_connection((host, port), timeout=10); break
    except ConnectionRefusedError:
        assert time.monotonic() < deadline
        time.sleep(0.05)
c.sendall(bytes(nbytes)); c.close(); print("ok")
"""
LISTEN = """
import socket, sys, time
s = socket.socket(); s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(); time.sleep(60)
"""


def connect(client, ip: str, port: int = PORT, timeout: float = 5.0) -> str:
    return client.run(python_argv("-c", CONNECT, ip, port, timeout), timeout=timeout + 10).stdout.strip()


def accept(server, n: int) -> subprocess.Popen:
    return server.popen(python_argv("-c", ACCEPT, PORT, n), stdout=subprocess.PIPE, text=True)


def peers_seen(server: subprocess.Popen) -> list[str]:
    out, _ = server.communicate(timeout=15)
    return out.split()


def transfer(sender, receiver, nbytes: int) -> float:
    """Seconds the receiver took to get `nbytes` over one TCP connection from `sender`."""
    sink = receiver.popen(python_argv("-c", SINK, PORT), stdout=subprocess.PIPE, text=True)
    sent = sender.run(python_argv("-c", SOURCE, receiver.ip, PORT, nbytes), timeout=30)
    assert sent.stdout.strip() == "ok", sent
    got, seconds = sink.communicate(timeout=30)[0].split()
    assert int(got) == nbytes
    return float(seconds)


def root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def test_public_hosts_reach_each_other_and_nothing_else():
    before = root_links()
    with Wan() as wan:
        a, b = wan.host("a"), wan.host("b")
        assert a.ip != b.ip
        server = accept(b, 1)
        assert connect(a, b.ip) == "ok"
        assert peers_seen(server) == [a.ip]
        # loopback is up inside; there is no route to anything outside the harness's internet
        assert connect(a, "127.0.0.1", timeout=0.2) == "ConnectionRefusedError"
        assert a.run(["ip", "route", "get", "1.1.1.1"]).returncode != 0
        assert a.run(["ip", "route", "get", b.ip]).returncode == 0
        assert root_links() == before  # every link lives inside the harness's namespaces


def test_shaped_link_runs_at_its_rate_both_ways():
    nbytes, mbit = 2_000_000, 8.0
    ideal = nbytes * 8 / (mbit * 1e6)  # 2 s
    with Wan() as wan:
        slow, fast, far = wan.host("slow", rate_mbit=mbit), wan.host("fast"), wan.host("far")
        up = transfer(slow, far, nbytes)
        down = transfer(far, slow, nbytes)
        unshaped = transfer(fast, far, nbytes)
    print(f"8 Mbit/s: up {up:.2f} s, down {down:.2f} s (ideal {ideal:.2f} s); unshaped {unshaped:.3f} s")
    assert 0.85 * ideal < up < 1.6 * ideal, up
    assert 0.85 * ideal < down < 1.6 * ideal, down
    assert up / unshaped > 5, (up, unshaped)


def test_an_asymmetric_line_uploads_at_its_upload_rate_and_downloads_at_its_link_rate():
    nbytes, up_mbit, down_mbit = 1_000_000, 8.0, 80.0
    ideal_up = nbytes * 8 / (up_mbit * 1e6)  # 1 s
    with Wan() as wan:
        home, far = wan.host("home", rate_mbit=down_mbit, up_mbit=up_mbit), wan.host("far")
        up = transfer(home, far, nbytes)
        down = transfer(far, home, nbytes)
    print(f"8 Mbit/s up: {up:.2f} s (ideal {ideal_up:.2f} s); 80 Mbit/s down: {down:.3f} s")
    assert 0.85 * ideal_up < up < 1.6 * ideal_up, up
    assert up / down > 4, (up, down)  # the download is not held to the upload's rate

def test_public_traffic_counts_each_hosts_upload_and_download():
    """Wan.public_traffic reads every host's link at the internet bridge in one call: what a host
    sends counts as its upload, what it receives as its download (the fan-out benchmark's link use)."""
    nbytes = 500_000
    with Wan() as wan:
        a, b = wan.host("a"), wan.host("b")
        wan.host("idle")
        before = wan.public_traffic()
        transfer(a, b, nbytes)
        after = wan.public_traffic()
    assert set(before) == set(after) == {"a", "b", "idle"}
    grew = {name: (after[name][0] - before[name][0], after[name][1] - before[name][1]) for name in after}
    assert nbytes <= grew["a"][0] < 1.2 * nbytes and nbytes <= grew["b"][1] < 1.2 * nbytes, grew
    assert grew["a"][1] < 0.2 * nbytes and grew["b"][0] < 0.2 * nbytes, grew  # acks, not the payload
    assert max(grew["idle"]) < 0.05 * nbytes, grew


@needs_nat
def test_nat_hides_the_lan():
    with Wan() as wan:
        router = wan.nat("home", rate_mbit=50)
        laptop, server = wan.behind(router, "laptop"), wan.host("server")
        assert ipaddress.ip_address(laptop.ip) in router.lan and laptop.public_ip == router.ip
        seen = accept(server, 1)
        assert connect(laptop, server.ip) == "ok"
        assert peers_seen(seen) == [router.ip]  # the router's public address, not 192.168.77.x

        laptop.popen(python_argv("-c", LISTEN, PORT))
        assert connect(router, laptop.ip) == "ok"  # the laptop listens: the LAN side can reach it
        assert connect(server, laptop.ip, timeout=2) == "OSError"  # no route to a private address
        # even routed to the router explicitly, a new inbound connection is dropped at the NAT
        server.run(["ip", "route", "add", str(router.lan), "via", router.ip], check=True)
        assert connect(server, laptop.ip, timeout=2) in {"TimeoutError", "timeout"}


@needs_nat
def test_two_homes_with_the_same_lan_appear_as_two_addresses():
    with Wan() as wan:
        home1, home2 = wan.nat("home1"), wan.nat("home2")
        assert home1.lan == home2.lan and home1.ip != home2.ip
        h1 = wan.behind(home1, "h1", ip="192.168.77.10")
        h2 = wan.behind(home2, "h2", ip="192.168.77.10")
        server = wan.host("server")
        seen = accept(server, 2)
        assert connect(h1, server.ip) == "ok" and connect(h2, server.ip) == "ok"
        assert sorted(peers_seen(seen)) == sorted([home1.ip, home2.ip])


SPAWNER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
print(child.pid, flush=True); time.sleep(60)
"""


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie left to init is gone too
    except FileNotFoundError:
        return True


def test_close_removes_namespaces_and_processes_even_after_an_exception():
    sleep = python_argv("-c", "import time; time.sleep(60)")
    with pytest.raises(RuntimeError, match="boom"):
        with Wan() as wan:
            a, b = wan.host("a"), wan.host("b", rate_mbit=10)
            p, q = a.popen(sleep), b.popen(sleep)
            spawner = b.popen(python_argv("-c", SPAWNER), stdout=subprocess.PIPE, text=True)
            grandchild = int(spawner.stdout.readline())  # left its parent's group: found by namespace
            # the Popen pid is the program itself, in the namespace, leading its own group
            assert os.readlink(f"/proc/{p.pid}/exe") == os.path.realpath(python_argv()[0])
            assert os.stat(f"/proc/{p.pid}/ns/net").st_ino == os.stat(f"/run/netns/{a.ns}").st_ino
            assert os.getpgid(p.pid) == p.pid
            p.kill()  # a test can kill one peer; the others go on
            assert p.wait(5) == -9 and q.poll() is None
            names = [a.ns, b.ns, wan.core]
            raise RuntimeError("boom")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [ns for ns in names if ns in listed.split()]
    assert q.poll() is not None and spawner.poll() is not None and gone(grandchild)
    wan.close()  # twice is fine


def test_sweep_removes_only_namespaces_of_dead_owners():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"gw{dead.pid}x0-stale"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with Wan() as wan:
            wan.host("alive")
            assert stale in sweep_stale()
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
            assert stale not in listed and f"{wan.prefix}-alive" in listed
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
