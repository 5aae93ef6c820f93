"""The `swarm` command group. Click only parses; each command imports its heavy libraries (torch,
transformers, hivemind) inside its body, so `swarm --help` stays fast."""

from __future__ import annotations

import click

from swarm import __version__
from swarm.cli.authorise import authorise_command, learner_key_command
from swarm.cli.config_command import config_command
from swarm.cli.dashboard import dashboard_command
from swarm.cli.launcher import die_with_launcher
from swarm.cli.local_commands import demo_command, eval_command, plot_command
from swarm.cli.peer_commands import bootstrap_command, learner_command, sampler_command, status_command


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="gepo-swarm")
def main() -> None:
    """GEPO Swarm: peer-to-peer RL post-training of language models."""
    die_with_launcher()  # a peer started by `swarm demo` or another local launcher ends with it


for command in (bootstrap_command, learner_command, sampler_command, status_command, dashboard_command, eval_command,
                demo_command, plot_command, authorise_command, learner_key_command, config_command):
    main.add_command(command)
