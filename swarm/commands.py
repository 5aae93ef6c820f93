"""Registers the `swarm` subcommands on the click group. Each command body imports late."""

from __future__ import annotations

import click


def register_commands(main: click.Group) -> None:
    pass
