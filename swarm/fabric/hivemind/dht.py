"""Start a hivemind DHT node for a run, with the swarm's record validators installed.

hivemind runs a DHT node in a forked process, which starts the p2p daemon (p2pd) as its own child.
Neither notices when the peer that made them dies: a learner killed with SIGKILL used to leave both
running, holding its port and, through the inherited lock file, its identity, so the resumed
learner came back under another key. Here the DHT process watches its parent and takes p2pd down
with it (`DHTWithParent`), and a peer that claims an identity first stops any p2pd still serving
that identity's key file from a dead predecessor (`stop_leftover_daemons`).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Sequence

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.utils.crypto import RSAPrivateKey

from swarm.config import split_host_port
from swarm.fabric.hivemind.log_filters import DemoteHandled
from swarm.fabric.hivemind.record_rules import OwnerRules
from swarm.fabric.hivemind.records import make_schema
from swarm.fabric.interface import JoinError
from swarm.fabric.membership.addresses import refused_join

logger = logging.getLogger(__name__)


PARENT_POLL_S = 0.5  # how soon a DHT process whose peer died notices and exits


def _gone_requester(record: logging.LogRecord, failure: BaseException | None) -> bool:
    """A request whose sender died before the DHT process read it (an averager process stopped with
    its learner) cannot be answered: the pipe it sent for the reply went with its resource sharer.
    hivemind's DHT loop logs that at ERROR with a traceback (ConnectionResetError or
    ConnectionRefusedError in multiprocessing's resource_sharer) and reads on; nothing is lost, and
    a learner killed mid-run printed it from its dying DHT process."""
    return record.funcName == "_run" and isinstance(failure, ConnectionError)


logging.getLogger("hivemind.dht.dht").addFilter(DemoteHandled(_gone_requester))  # before a DHT process forks: it inherits it


def listen_maddrs(host: str, port: int) -> list[str]:
    """TCP multiaddrs to listen on: an IPv4 or IPv6 literal host, port 0 meaning any free port."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be 0..65535, got {port}")
    family = "ip6" if ":" in host else "ip4"
    return [f"/{family}/{host}/tcp/{port}"]


def announce_multiaddrs(announce_addr: str | None, port: int) -> tuple[int, list[str]]:
    """(port to listen on, multiaddrs to announce) for `announce_addr` (HOST, HOST:PORT or a
    multiaddr). libp2p announces an explicit port, so with --port 0 and a HOST alone a free port
    is chosen here for both."""
    if not announce_addr:
        return port, []
    if announce_addr.startswith("/"):
        return port, [announce_addr]

    host, announced_port = split_host_port(announce_addr)
    if announced_port is None:
        port = port or free_port()
    return port, listen_maddrs(host, announced_port or port)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def exit_with_parent(parent_pid: int) -> None:
    """In the DHT process: once `parent_pid` is gone (the peer died, even by SIGKILL), or when this
    process is told to terminate (multiprocessing does so at the peer's exit), kill this process's
    own children (p2pd) and exit. Polling the parent id needs no cooperation from hivemind."""
    import signal

    import psutil

    def end(*_) -> None:
        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent_pid:
            threading.Event().wait(PARENT_POLL_S)
        end()

    signal.signal(signal.SIGTERM, end)
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


class DHTWithParent(hivemind.DHT):
    """A hivemind DHT whose process (and p2pd) ends when the peer that started it does, and only
    then: it leaves the peer's process group, so that a Ctrl-C in the terminal (which signals the
    whole foreground group) reaches the peer alone. p2pd used to take that SIGINT itself and shut down
    under the peer while it was still leaving the swarm ("[ERROR] ... use of closed network
    connection", then "DHT did not shut down within the grace period"). The peer stops them in
    order; `exit_with_parent` still ends them if it dies."""

    def run(self) -> None:
        try:
            os.setpgid(0, 0)
        except OSError:  # not permitted (a session leader): the Ctrl-C reaches p2pd as before
            pass
        exit_with_parent(self._parent_pid)
        super().run()


def stop_leftover_daemons(identity_path: Path, *, timeout_s: float = 5.0) -> list[int]:
    """Kill p2p daemons still running with the key file `identity_path` (leftovers of a peer that
    died before it could stop them); their pids. Only called by the peer that holds the identity's
    lock (swarm.fabric.membership.identity.claim_identity_slot), so no live peer uses that key file."""
    import psutil

    flag = f"-id={Path(identity_path).resolve()}"
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if cmdline and Path(cmdline[0]).name == "p2pd" and flag in cmdline:
            try:
                proc.kill()
                found.append(proc)
            except psutil.Error:
                pass
    psutil.wait_procs(found, timeout=timeout_s)
    if found:
        logger.warning("stopped %d p2p daemon(s) left running with %s by a peer that died", len(found), identity_path)
    return [p.pid for p in found]


def start_dht(
    run_id: str,
    *,
    initial_peers: Sequence[str] = (),
    host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
    announce_maddrs: Sequence[str] = (),
    use_auto_relay: bool = False,
    public: bool = False,
    client_mode: bool = False,
    identity_path: Path | None = None,
    reclaim_identity: bool = False,
    signing_key=None,
    startup_timeout: float = 30.0,
):
    """A running `hivemind.DHT` (in its own process) and its RSASignatureValidator.

    identity_path: libp2p key file (created if missing) for a stable peer id.
    reclaim_identity: first stop p2p daemons a dead peer left running with that key file (only for
    a caller that holds the identity's lock, as `transports.join` does).
    signing_key: RSAPrivateKey for this peer's records (a fresh one if None).
    announce_maddrs: the addresses other peers are told to dial (a public address in front of a NAT
    or port forward); unset: those p2pd observes on its interfaces.
    use_auto_relay: find a relay among the swarm's public peers (by default the bootstrap nodes)
    and be reachable through it: for a peer behind a NAT that must accept streams.
    public: this node is reachable from the internet (a bootstrap node): it relays for peers
    behind NATs from the start rather than once AutoNAT has confirmed it (which a small swarm may
    never do).
    client_mode: take no part in the DHT's routing and storage (for a peer behind a NAT nobody can
    dial: others would try it for every lookup); it still reads and writes records, and its
    streams (rollouts, weights) work over the connections it opens.
    Raises JoinError naming the addresses when none of `initial_peers` answers in time.
    """

    for addr in initial_peers:
        if not str(addr).startswith("/"):
            raise ValueError(f"peer address {addr!r} is not a multiaddr; pass one like /ip4/1.2.3.4/tcp/31337/p2p/Qm...")

    # A fresh key rather than hivemind's process-wide default: two nodes in one process (tests,
    # a demo) must not be able to sign each other's records.
    signature = RSASignatureValidator(signing_key or RSAPrivateKey())
    validators = [SchemaValidator(make_schema(run_id), allow_extra_keys=True, prefix=run_id), signature, OwnerRules(run_id)]
    kwargs = dict(host_maddrs=list(host_maddrs), startup_timeout=startup_timeout, client_mode=client_mode,
                  use_auto_relay=use_auto_relay)
    if announce_maddrs:
        kwargs["announce_maddrs"] = list(announce_maddrs)
    if use_auto_relay:
        # libp2p looks for a relay only once AutoNAT has found the node unreachable, which takes
        # several peers dialling back: a small swarm may never get there. A peer that asks for a
        # relay knows it is behind a NAT, so say so; its relays are the peers it joins through.
        kwargs["force_reachability"] = "private"
        kwargs["trusted_relays"] = list(initial_peers)
    elif public:
        kwargs["force_reachability"] = "public"
    if identity_path is not None:
        Path(identity_path).parent.mkdir(parents=True, exist_ok=True)
        kwargs["identity_path"] = str(Path(identity_path).resolve())
        if reclaim_identity:
            stop_leftover_daemons(Path(identity_path))
    refused = refused_join("hivemind", initial_peers)
    if refused:
        raise JoinError(refused)
    try:
        dht = DHTWithParent(initial_peers=list(initial_peers), start=True, record_validators=validators, **kwargs)
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


__all__ = ["JoinError", "listen_maddrs", "start_dht", "stop_leftover_daemons"]
