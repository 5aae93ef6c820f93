"""The `swarm` command. Click only parses; each command imports its heavy libraries (torch,
transformers, hivemind) inside its body, so `swarm --help` stays fast."""

from __future__ import annotations

import click

from swarm import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="gepo-swarm")
def main() -> None:
    """GEPO Swarm: peer-to-peer RL post-training of language models."""


from swarm.commands import register_commands  # noqa: E402  (the commands attach to `main`)

register_commands(main)


if __name__ == "__main__":
    main()
