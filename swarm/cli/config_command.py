"""`swarm config ROLE`: print a role's commented default config file (swarm/config/template.py)."""

from __future__ import annotations

import click

from swarm.config import CONFIGS


@click.command("config")
@click.argument("role", type=click.Choice(list(CONFIGS)))
def config_command(role: str):
    """Print ROLE's default config file (TOML): every setting with its description and default.

    Save it, edit it and pass it back: `swarm config learner > run.toml; swarm learner --config run.toml`."""
    from swarm.config.template import default_config_text

    click.echo(default_config_text(role), nl=False)
