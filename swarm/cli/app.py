"""The `swarm` command group. Click only parses; each command imports its heavy libraries (torch,
transformers, hivemind) inside its body, so `swarm --help` stays fast."""

from __future__ import annotations

import signal

import click

from swarm import __version__
from swarm.cli.authorise import authorise_command, learner_key_command
from swarm.cli.config_command import config_command
from swarm.cli.dashboard import dashboard_command
from swarm.cli.launcher import die_with_launcher
from swarm.cli.local_commands import demo_command, eval_command, plot_command
from swarm.cli.peer_commands import bootstrap_command, learner_command, sampler_command, status_command
from swarm.signals import stopped_by

CTRL_C_STATUS = 130  # 128 + SIGINT: what a shell reports for a program that Ctrl-C ended


class SwarmGroup(click.Group):
    """The `swarm` group: a command that Ctrl-C stopped ends with one line and exit status 130, at
    any moment. A peer stops on its own (its SIGINT handler sets its stop event, and it finishes its
    round and checkpoints) and returns; any other command is interrupted where it is
    (KeyboardInterrupt). click's own answer to a KeyboardInterrupt ("Aborted!", status 1) told a
    script nothing. An error raised after the Ctrl-C (a daemon that the same Ctrl-C ended, when the
    terminal signalled the whole process group) is a consequence of the stop, said in that line.
    (A peer that SIGTERM stopped exits 0, as before: it ended as asked, after its checkpoint.)"""

    def invoke(self, ctx: click.Context):
        try:
            result = super().invoke(ctx)
        except KeyboardInterrupt:
            _stopped()
        except (click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:  # noqa: BLE001  only swallowed after a Ctrl-C: re-raised otherwise
            if stopped_by() != signal.SIGINT:
                raise
            _stopped(f"{type(exc).__name__}: {exc}")
        if stopped_by() == signal.SIGINT:
            _stopped()
        return result


def _stopped(on_the_way_out: str = "") -> None:
    """One line and the exit status of a Ctrl-C (or of the SIGTERM that `swarm demo` takes as one)."""
    note = f" (on the way out: {' '.join(on_the_way_out.split())[:300]})" if on_the_way_out else ""
    if stopped_by() == signal.SIGTERM:
        click.echo(f"stopped by SIGTERM{note}", err=True)
        raise click.exceptions.Exit(128 + signal.SIGTERM)
    click.echo(f"stopped by Ctrl-C{note}", err=True)
    raise click.exceptions.Exit(CTRL_C_STATUS)


@click.group(cls=SwarmGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="gepo-swarm")
def main() -> None:
    """GEPO Swarm: peer-to-peer RL post-training of language models."""
    die_with_launcher()  # a peer started by `swarm demo` or another local launcher ends with it


for command in (bootstrap_command, learner_command, sampler_command, status_command, dashboard_command, eval_command,
                demo_command, plot_command, authorise_command, learner_key_command, config_command):
    main.add_command(command)
