"""`swarm authorize` and `swarm learner-key`: letting one more learner train a run.

The run owner (whoever holds the first learner's signing key, or an offline key they keep) signs a
certificate for the new learner's key; the new learner passes it as `--certificate`. Samplers need
nothing new: they pin the run's owner key (`--learner-key`), and accept versions from any learner
it certified."""

from __future__ import annotations

from pathlib import Path

import click

from swarm.cli.options import GroupedCommand, GroupedOption, user_errors
from swarm.config import TRANSPORTS, SwarmSettings, default_of
from swarm.config.learner_keys import decode_learner_key, encode_learner_key
from swarm.fabric.membership.authority import CERTIFICATE_DAYS, MAX_CERTIFICATE_DAYS, issue, parse_revocations, revoke
from swarm.fabric.membership.identity import (
    first_learner_key_file,
    identity_dir_or_default,
    load_existing_signing_key,
    load_or_create_signing_key,
)
from swarm.fabric.signing import owner_key


@click.command("authorize", cls=GroupedCommand)  # the command keeps the spelling users type; code names are British
@click.option("--owner-key-file", required=True, type=click.Path(dir_okay=False, path_type=Path), cls=GroupedOption,
              group="swarm", help="the run owner's signing key: the first learner's (its ready.json names it as "
                                  "owner_key_file), or an offline key made with `swarm learner-key --new-owner FILE`")
@click.option("--learner-key", default=None, cls=GroupedOption, group="swarm",
              help="the key of the learner to let in (`swarm learner-key` prints it on that learner's machine)")
@click.option("--run-id", required=True, cls=GroupedOption, group="swarm", help="the run it may train")
@click.option("--days", default=CERTIFICATE_DAYS, type=click.FloatRange(min=0, min_open=True, max=MAX_CERTIFICATE_DAYS),
              show_default=True, cls=GroupedOption, group="swarm", help="the certificate expires after this many days")
@click.option("--revoke", multiple=True, cls=GroupedOption, group="swarm",
              help="instead: take back this learner key's certificate (repeatable); the owner's revocation list, kept "
                   "in OWNER_KEY_FILE.revoked-RUN_ID, is published to the swarm through --peers")
@click.option("--peers", multiple=True, cls=GroupedOption, group="swarm",
              help="with --revoke: the run's swarm to publish the revocation list through (a hivemind multiaddr, "
                   "or the gRPC registry's KEYID@HOST:PORT with --transport grpc)")
@click.option("--transport", type=click.Choice(TRANSPORTS), default=default_of(SwarmSettings, "transport"), show_default=True,
              cls=GroupedOption, group="swarm", help="with --revoke --peers: the run's transport")
@click.option("--insecure", is_flag=True, cls=GroupedOption, group="swarm",
              help="with --transport grpc: a registry that runs --insecure (plain text)")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, cls=GroupedOption, group="output",
              help="write the certificate to this file (mode 0600) instead of printing it")
def authorise_command(owner_key_file, learner_key, run_id, days, revoke, peers, transport, insecure, out):
    """Certify a learner's key for a run: prints the certificate it passes as `--certificate`.
    With --revoke, take certificates back: samplers and learners refuse the keys named."""
    if revoke:
        _revoke(owner_key_file, run_id, revoke, peers, transport, insecure)
        return
    if not learner_key:
        raise click.UsageError("--learner-key is needed (the key to certify), or --revoke KEY to take one back")
    with user_errors():
        owner = load_existing_signing_key(owner_key_file)
        cert = issue(owner, run_id, decode_learner_key(learner_key.strip()), days=days)
    if out is None:
        click.echo(cert.token)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.touch(mode=0o600)
    out.write_text(cert.token + "\n")
    click.echo(f"certificate for run '{run_id}' written to {out}; the learner passes --certificate {out}")


def revocations_file(owner_key_file: Path, run_id: str) -> Path:
    return Path(f"{owner_key_file}.revoked-{run_id}")


def _revoke(owner_key_file: Path, run_id: str, keys, peers, transport: str, insecure: bool) -> None:
    """Add `keys` to the owner's revocation list for `run_id`, keep it beside the owner key, and
    publish it through `peers` (it lasts in the swarm as long as a certificate can)."""
    with user_errors():
        owner = load_existing_signing_key(owner_key_file)
        path = revocations_file(owner_key_file, run_id)
        previous = parse_revocations(path.read_text().strip()) if path.is_file() else None
        revocations = revoke(owner, run_id, [decode_learner_key(k.strip()) for k in keys], previous)
        path.touch(mode=0o600)
        path.write_text(revocations.token + "\n")
    click.echo(f"{len(revocations.revoked)} key(s) revoked in run '{run_id}'; the list is kept in {path}")
    if not peers:
        click.echo("not published yet: run this again with --peers ADDR (the run's swarm) to publish it")
        return
    publish = _publish_grpc if transport == "grpc" else _publish_hivemind
    publish(owner, revocations, list(peers), insecure)
    click.echo(f"published to the swarm through {', '.join(peers)}: samplers and learners refuse the revoked key(s)")


def _publish_hivemind(owner, revocations, peers: list[str], insecure: bool) -> None:
    from swarm.fabric.hivemind.dht import start_dht  # hivemind pulls in torch: not at `swarm --help`
    from swarm.fabric.hivemind.records import store_revocations

    with user_errors(TimeoutError, OSError):
        dht, _ = start_dht(revocations.run_id, initial_peers=peers, client_mode=True, signing_key=owner)
        try:
            if not store_revocations(dht, owner_key(owner), revocations):
                raise OSError(f"no node of the swarm at {', '.join(peers)} stored the revocation list; check --peers and try again")
        finally:
            dht.shutdown()


def _publish_grpc(owner, revocations, peers: list[str], insecure: bool) -> None:
    """Post the list to the run's registry, signed by the owner's key (the registry takes a list
    only from the key that signed it)."""
    from swarm.fabric.grpc.fabric import GrpcFabric  # grpc and torch: not at `swarm --help`
    from swarm.fabric.interface import JoinError

    with user_errors(JoinError, TimeoutError, OSError):
        fabric = GrpcFabric(peers[0], revocations.run_id, owner, serve=False, insecure=insecure,
                            heartbeat_s=default_of(SwarmSettings, "heartbeat_s"))
        try:
            stored, reason = fabric.publish_revocations(revocations)
        finally:
            fabric.shutdown()
        if not stored:
            raise OSError(f"the registry at {peers[0]} refused the revocation list: {reason}")


@click.command("learner-key", cls=GroupedCommand)
@click.option("--identity-dir", type=click.Path(file_okay=False, path_type=Path), default=None, cls=GroupedOption,
              group="swarm", help="the learner's --identity-dir (unset: the default one)")
@click.option("--new-owner", type=click.Path(dir_okay=False, path_type=Path), default=None, cls=GroupedOption,
              group="swarm", help="instead: make an offline run-owner key in this file and print its public key "
                                  "(samplers pin it; every learner of the run then needs a certificate)")
def learner_key_command(identity_dir, new_owner):
    """Print the key a learner started from this machine's identity directory runs with (the run
    owner certifies it with `swarm authorize`)."""
    with user_errors():
        if new_owner is not None:
            if new_owner.exists():
                raise click.UsageError(f"--new-owner {new_owner} exists; an owner key is never overwritten")
            path = new_owner
        else:
            path = first_learner_key_file(identity_dir_or_default(identity_dir))
        key = load_or_create_signing_key(path)
    click.echo(encode_learner_key(owner_key(key)))
