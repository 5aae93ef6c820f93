"""Extra learners' certificates expire, and the run owner takes them back (`swarm authorize
--revoke`): on a real swarm (bootstrap and learner processes, the CLI as a user runs it), an expired
or revoked learner is refused at start-up with a message naming its key and what to do, and what a
revoked learner announces or heartbeats is ignored by samplers' and learners' lookups."""

import json
import subprocess
import sys
import time

import pytest

from benchmarks.waiting import wait_until
from swarm.cli.launcher import LocalSwarm
from swarm.config.learner_keys import decode_learner_key
from swarm.fabric.membership.authority import CertificateError, issue, key_fingerprint, parse, revoke
from tests.helpers.processes import kill_started

pytestmark = pytest.mark.slow
SWARM = [sys.executable, "-m", "swarm.cli"]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*SWARM, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def swarm(tmp_path):
    local = LocalSwarm(tmp_path, run_id="certs")
    try:
        yield local
    finally:
        kill_started(local)  # only the processes this test started, by pid


def test_certificates_expire_and_a_revoked_learner_is_refused_everywhere(swarm, tmp_path):
    from swarm.fabric.hivemind.dht import start_dht
    from swarm.fabric.hivemind.fabric import HivemindFabric
    from swarm.fabric.membership.identity import load_or_create_signing_key
    from swarm.fabric.membership.records import Heartbeat

    addr = swarm.start_bootstrap()
    owner_learner, run_key = swarm.start_learner(addr, "--steps", "1000", "--checkpoint-every", "0")
    owner_key_file = owner_learner.ready["owner_key_file"]
    owner = decode_learner_key(run_key)

    # the second learner's key, as its machine prints it
    second_dir = tmp_path / "keys" / "second"
    made = cli("learner-key", "--identity-dir", str(second_dir))
    assert made.returncode == 0, made.stderr
    second_key = made.stdout.strip()

    # an expired certificate: refused at start-up, naming the key and what to do
    expired = cli("authorize", "--owner-key-file", owner_key_file, "--learner-key", second_key, "--run-id", "certs",
                  "--days", "0.00001", "--out", str(tmp_path / "expired.cert"))
    assert expired.returncode == 0, expired.stderr
    time.sleep(1.5)
    started = cli("learner", "--peers", addr, "--run-id", "certs", "--identity-dir", str(second_dir), "--certificate",
                  str(tmp_path / "expired.cert"), "--run-dir", str(tmp_path / "expired-run"))
    fingerprint = key_fingerprint(decode_learner_key(second_key))
    assert started.returncode != 0
    assert "expired" in started.stderr and fingerprint[:16] in started.stderr and "swarm authorize" in started.stderr

    # a valid certificate: the second learner's announcement and record count...
    good = cli("authorize", "--owner-key-file", owner_key_file, "--learner-key", second_key, "--run-id", "certs",
               "--out", str(tmp_path / "good.cert"))
    assert good.returncode == 0, good.stderr
    certificate = (tmp_path / "good.cert").read_text().strip()
    second = HivemindFabric(*start_dht("certs", initial_peers=[addr], signing_key=load_or_create_signing_key(
        second_dir / "learner.sign.key")), "certs", heartbeat_s=5.0)
    observer = HivemindFabric(*start_dht("certs", initial_peers=[addr], client_mode=True), "certs", heartbeat_s=5.0)
    try:
        second.certificate = certificate
        assert second.heartbeat(Heartbeat(role="learner", version=7, certificate=certificate))
        assert second.announce(777, "0" * 64)
        wait_until(lambda: (observer.latest_announced([owner]) or 0) and observer.latest_announced([owner]).version == 777,
                   30, "the certified learner's version")
        assert second.peer_id in [m.record.peer_id for m in observer.authorised_learners([owner])]

        # ...until the owner revokes its key: published to the swarm through --peers
        revoked = cli("authorize", "--owner-key-file", owner_key_file, "--run-id", "certs", "--revoke", second_key,
                      "--peers", addr)
        assert revoked.returncode == 0, revoked.stderr
        assert "published" in revoked.stdout
        wait_until(lambda: fingerprint in observer.revoked([owner]), 30, "the revocation list")
        # samplers' lookup: the revoked learner's announcement no longer counts
        assert second.announce(778, "0" * 64)
        latest = observer.latest_announced([owner])
        assert latest is None or latest.version < 777
        # learners' lookup: it is no longer one of the run's learners
        assert second.peer_id not in [m.record.peer_id for m in observer.authorised_learners([owner])]
    finally:
        second.shutdown()
        observer.shutdown()

    # the revoked learner itself is refused at start-up, its key named, with what to do
    started = cli("learner", "--peers", addr, "--run-id", "certs", "--identity-dir", str(second_dir), "--certificate",
                  str(tmp_path / "good.cert"), "--run-dir", str(tmp_path / "revoked-run"), timeout=180)
    assert started.returncode != 0
    assert "revoked" in started.stderr and fingerprint[:16] in started.stderr, started.stderr[-2000:]
    assert swarm.stop(owner_learner) == 0, owner_learner.text()[-3000:]


def test_a_certificate_names_its_expiry_and_a_revocation_list_only_grows():
    from hivemind.utils.crypto import RSAPrivateKey

    from swarm.fabric.signing import owner_key

    owner, learner, other = RSAPrivateKey(), RSAPrivateKey(), RSAPrivateKey()
    cert = issue(owner, "run", owner_key(learner), now=1000.0, days=1.0)
    assert cert.expires == 1000.0 + 86400.0
    assert cert.problem(now=2000.0) == "" and "expired" in cert.problem(now=1000.0 + 86401.0)
    first = revoke(owner, "run", [owner_key(learner)], now=10.0)
    second = revoke(owner, "run", [owner_key(other)], previous=first, now=20.0)
    assert second.revoked == {key_fingerprint(owner_key(learner)), key_fingerprint(owner_key(other))}
    assert "revoked" in parse(cert.token).problem(now=2000.0, revoked=second.revoked)
    with pytest.raises(CertificateError, match="another owner"):
        revoke(RSAPrivateKey(), "run", [], previous=first)
    # a certificate from before expiries is refused with what to do
    body = json.dumps({"run_id": "run", "learner": "eA", "owner": "eA", "issued": 1.0}).encode()
    import base64

    token = base64.urlsafe_b64encode(body).decode().rstrip("=") + ".AAAA"
    with pytest.raises(CertificateError, match="no expiry"):
        parse(token)
