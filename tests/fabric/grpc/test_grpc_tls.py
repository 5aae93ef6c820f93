"""TLS on the gRPC transport (issue 45, point 7), with real gRPC servers on loopback: by default
every server presents a certificate made from its signing key, and a client checks it against the
key id of the peer id it dials; a server holding another key is refused before anything is sent;
a plain-text client cannot talk to a TLS server (nor a TLS client to a plain-text one); a man in the
middle that rewrites a rollout frame in plain text succeeds, and over TLS fails without delivering
anything; `insecure` mode warns and works."""

import logging
import socket
import threading

import grpc
import pytest
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.waiting import wait_until
from swarm.fabric.grpc.common import RequestSigner, key_id, peer_id_of
from swarm.fabric.grpc.fabric import GrpcFabric
from swarm.fabric.grpc.registry import GrpcBootstrap
from swarm.fabric.grpc.rollouts import GrpcRolloutInbox, GrpcRolloutSender
from swarm.fabric.grpc.server import Channels, GrpcPeerServer
from swarm.fabric.grpc.tls import INSECURE_WARNING, WrongPeerKey
from swarm.fabric.interface import JoinError
from swarm.fabric.local import LocalFabrics
from swarm.fabric.membership.records import Heartbeat
from swarm.fabric.signing import owner_key
from swarm.fabric.weights.versions import VersionStore
from tests.fabric.grpc.test_grpc_hostile import VOCAB, group

RUN = "grpc-tls-test"


@pytest.fixture
def swarm():
    with LocalFabrics("grpc", RUN) as fabrics:
        def make():
            return fabrics.make()

        make.registry = fabrics.bootstrap
        yield make


def test_a_server_whose_key_is_not_the_one_its_peer_id_names_is_refused(swarm):
    learner, sampler = swarm(), swarm()
    inbox = learner.rollout_inbox(vocab_size=VOCAB)
    inbox.learner_version = 3
    try:
        # another key's id in front of the learner's address: the learner's certificate does not match it
        impostor_id = peer_id_of(key_id(owner_key(RSAPrivateKey())), learner.server.address)
        with pytest.raises(WrongPeerKey, match=f"holds key {learner.key_id}, not"):
            sampler.rollout_sender(timeout_s=10).send(impostor_id, [group("to the wrong key")])
        with pytest.raises(WrongPeerKey):
            sampler.weight_client(timeout_s=10).fetch(impostor_id, 0, "0" * 64, VersionStore())
        assert inbox.qsize() == 0
        # the same address under the learner's own key id is served
        assert sampler.rollout_sender(timeout_s=10).send(learner.peer_id, [group("right key")]) == [{"ok": True}]
        assert inbox.get(timeout=5).problem_id == "right key"
        # and a registry whose key is not the one in its address is refused at join, with the reason
        wrong_registry = peer_id_of(key_id(owner_key(RSAPrivateKey())), swarm.registry.addresses()[0].partition("@")[2])
        with pytest.raises(JoinError, match="not .* as its peer id says"):
            GrpcFabric(wrong_registry, RUN, RSAPrivateKey(), serve=False, heartbeat_s=1.0, timeout_s=5)
    finally:
        inbox.close()


def test_plain_text_and_tls_do_not_talk_to_each_other(swarm):
    learner = swarm()
    inbox = learner.rollout_inbox(vocab_size=VOCAB)
    inbox.learner_version = 3
    plain_key = RSAPrivateKey()
    plain_server = GrpcPeerServer("127.0.0.1", 0, RUN, insecure=True)
    plain_channels = Channels(insecure=True)
    try:
        # a plain-text client at a TLS server: gRPC cannot even open the connection
        signer = RequestSigner(plain_key, RUN, peer_id_of(key_id(owner_key(plain_key)), "127.0.0.1:1"))
        with pytest.raises(grpc.RpcError) as refused:
            GrpcRolloutSender(plain_channels, signer, timeout_s=3).send(learner.peer_id, [group("plain")])
        assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert inbox.qsize() == 0
        # a TLS client at a plain-text server: refused with the reason, before any request is sent
        tls_client = swarm()
        with pytest.raises(ConnectionError, match="does not speak TLS"):
            tls_client.channels.get(plain_server.address)
    finally:
        plain_channels.close()
        plain_server.stop()
        inbox.close()


class RewritingProxy:
    """A man in the middle on TCP: relays both ways between its port and `target`, replacing
    `old` by `new` (same length) in what the client sends."""

    def __init__(self, target: str, old: bytes, new: bytes) -> None:
        host, _, port = target.rpartition(":")
        self.target, self.old, self.new = (host, int(port)), old, new
        self.rewrites = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self.sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, rewrite: bool) -> None:
        try:
            while data := source.recv(65536):
                if rewrite and self.old in data:
                    data, self.rewrites = data.replace(self.old, self.new), self.rewrites + 1
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()
        for s in self.sockets:
            s.close()


def _through(proxy: RewritingProxy, fabric) -> str:
    """The fabric's peer id with the proxy's address: the key stays the learner's, the path goes through the proxy."""
    return peer_id_of(fabric.key_id, proxy.address)


@pytest.mark.parametrize("insecure", [True, False])
def test_a_frame_rewritten_on_the_path_is_delivered_only_in_plain_text(insecure):
    registry = GrpcBootstrap(RUN, host="127.0.0.1", port=0, insecure=insecure)
    peers = [GrpcFabric(registry.addresses()[0], RUN, RSAPrivateKey(), heartbeat_s=1.0, insecure=insecure) for _ in range(2)]
    learner, sampler = peers
    inbox = learner.rollout_inbox(vocab_size=VOCAB)
    inbox.learner_version = 3
    proxy = RewritingProxy(learner.server.address, b"honest-problem", b"forged-problem")
    try:
        target = _through(proxy, learner) if not insecure else proxy.address
        try:
            sampler.rollout_sender(timeout_s=5).send(target, [group("honest-problem")])
        except (grpc.RpcError, ConnectionError):
            pass  # over TLS the tampered record breaks the connection
        if insecure:  # the attack as it was: the frame arrives rewritten, and nobody can tell
            received = inbox.get(timeout=5)
            assert proxy.rewrites >= 1 and received.problem_id == "forged-problem"
        else:  # under TLS the proxy sees only ciphertext: nothing to rewrite, and what it passes on is the honest group
            received = inbox.get(timeout=5)
            assert proxy.rewrites == 0 and received.problem_id == "honest-problem"
            assert inbox.get(timeout=0.5) is None
    finally:
        proxy.close()
        inbox.close()
        for peer in peers:
            peer.shutdown()
        registry.shutdown()


def test_insecure_mode_warns_and_works(caplog):
    with caplog.at_level(logging.WARNING):
        registry = GrpcBootstrap(RUN, host="127.0.0.1", port=0, insecure=True)
        peers = [GrpcFabric(registry.addresses()[0], RUN, RSAPrivateKey(), heartbeat_s=1.0, insecure=True) for _ in range(2)]
    learner, sampler = peers
    inbox = learner.rollout_inbox(vocab_size=VOCAB)
    inbox.learner_version = 3
    try:
        assert INSECURE_WARNING in caplog.text and "@" not in registry.addresses()[0]  # nothing to pin: no key id
        assert learner.heartbeat(Heartbeat(role="learner")) and sampler.heartbeat(Heartbeat(role="sampler"))
        assert wait_until(lambda: len(sampler.members()) == 2, 5)
        assert sampler.rollout_sender(timeout_s=10).send(learner.peer_id, [group("plain")]) == [{"ok": True}]
        assert inbox.get(timeout=5).problem_id == "plain"
    finally:
        inbox.close()
        for peer in peers:
            peer.shutdown()
        registry.shutdown()


def test_a_peer_restarted_with_its_key_is_reached_again_through_the_pinned_channel(swarm):
    key, sampler = RSAPrivateKey(), swarm()
    server = GrpcPeerServer("127.0.0.1", 0, RUN, signing_key=key)
    port, peer = server.port, peer_id_of(server.key_id, server.address)
    inbox = GrpcRolloutInbox(server, vocab_size=VOCAB)
    inbox.learner_version = 3
    assert sampler.rollout_sender(timeout_s=10).send(peer, [group("before")]) == [{"ok": True}]
    inbox.close()
    server.stop()
    server = GrpcPeerServer("127.0.0.1", port, RUN, signing_key=key)  # the same key: the same certificate
    inbox = GrpcRolloutInbox(server, vocab_size=VOCAB)
    inbox.learner_version = 3

    def delivered() -> bool:
        try:
            return sampler.rollout_sender(timeout_s=5).send(peer, [group("after")]) == [{"ok": True}]
        except grpc.RpcError:  # while the channel reconnects
            return False

    try:
        assert wait_until(delivered, 15, every=0.5)
        assert inbox.get(timeout=5).problem_id == "after"
    finally:
        inbox.close()
        server.stop()


def test_insecure_is_a_grpc_option():
    from swarm.config import SwarmSettings

    assert SwarmSettings(peers=["127.0.0.1:1"], transport="grpc", insecure=True).insecure
    with pytest.raises(ValueError, match="libp2p .* always encrypts"):
        SwarmSettings(peers=["/ip4/127.0.0.1/tcp/1/p2p/QmX"], transport="hivemind", insecure=True)


def test_swarm_status_with_insecure_talks_to_a_plain_text_registry_and_without_it_says_why_not():
    """The --insecure flag in real `swarm status` processes, against a registry without TLS."""
    import os
    import subprocess
    import sys

    registry = GrpcBootstrap(RUN, host="127.0.0.1", port=0, insecure=True)
    address = registry.addresses()[0]
    try:
        def status(*flags):
            return subprocess.run([sys.executable, "-m", "swarm.cli", "status", "--transport", "grpc", "--peers", address,
                                   "--run-id", RUN, "--json", *flags], capture_output=True, text=True, timeout=120,
                                  env=dict(os.environ, PYTHONUNBUFFERED="1"))

        insecure = status("--insecure")
        assert insecure.returncode == 0 and '"peers": []' in insecure.stdout, insecure.stderr[-2000:]
        assert "TLS is off (--insecure)" in insecure.stderr
        default = status()  # TLS, at a plain-text registry: refused before anything is sent, with what to do
        assert default.returncode == 1 and "Traceback" not in default.stderr, default.stderr[-2000:]
        assert "does not speak TLS" in default.stderr and "--insecure" in default.stderr
    finally:
        registry.shutdown()
