"""Where the commands print tables: rich consoles on stdout that fit a terminal, and that print every
line whole off one. Off a terminal (a pipe, a file, a script's capture) rich assumes 80 columns and
squeezes a table into them ("stalen…", ids cut mid-way), which nobody reading a log wants."""

from __future__ import annotations

import sys

OFF_TERMINAL_WIDTH = 1000  # columns: wider than any row these commands print, so nothing is cut or wrapped


def stdout_console():
    """A rich Console on stdout: the terminal's width on a terminal, whole lines off one."""
    from rich.console import Console  # rich: imported when a command prints, not at `swarm --help`

    return Console() if sys.stdout.isatty() else Console(width=OFF_TERMINAL_WIDTH)
