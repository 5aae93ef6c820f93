"""`swarm authorize` and `swarm learner-key`: letting one more learner train a run.

The run owner (whoever holds the first learner's signing key, or an offline key they keep) signs a
certificate for the new learner's key; the new learner passes it as `--certificate`. Samplers need
nothing new: they pin the run's owner key (`--learner-key`), and accept versions from any learner
it certified."""

from __future__ import annotations

from pathlib import Path

import click

from swarm.cli.options import GroupedCommand, GroupedOption, user_errors
from swarm.config.learner_keys import decode_learner_key, encode_learner_key
from swarm.fabric.membership.authority import issue
from swarm.fabric.membership.identity import identity_dir_or_default, load_existing_signing_key, load_or_create_signing_key
from swarm.fabric.signing import owner_key


@click.command("authorize", cls=GroupedCommand)  # the command keeps the spelling users type; code names are British
@click.option("--owner-key-file", required=True, type=click.Path(dir_okay=False, path_type=Path), cls=GroupedOption,
              group="swarm", help="the run owner's signing key: the first learner's (its ready.json names it as "
                                  "owner_key_file), or an offline key made with `swarm learner-key --new-owner FILE`")
@click.option("--learner-key", required=True, cls=GroupedOption, group="swarm",
              help="the key of the learner to let in (`swarm learner-key` prints it on that learner's machine)")
@click.option("--run-id", required=True, cls=GroupedOption, group="swarm", help="the run it may train")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, cls=GroupedOption, group="output",
              help="write the certificate to this file (mode 0600) instead of printing it")
def authorise_command(owner_key_file, learner_key, run_id, out):
    """Certify a learner's key for a run: prints the certificate it passes as `--certificate`."""
    with user_errors():
        owner = load_existing_signing_key(owner_key_file)
        cert = issue(owner, run_id, decode_learner_key(learner_key.strip()))
    if out is None:
        click.echo(cert.token)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.touch(mode=0o600)
    out.write_text(cert.token + "\n")
    click.echo(f"certificate for run '{run_id}' written to {out}; the learner passes --certificate {out}")


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
            path = identity_dir_or_default(identity_dir) / "learner.sign.key"
        key = load_or_create_signing_key(path)
    click.echo(encode_learner_key(owner_key(key)))
