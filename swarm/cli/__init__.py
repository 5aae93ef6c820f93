"""The top layer: the `swarm` command and what it shows people. Nothing below imports it.

- app.py             - the `swarm` click group (entry point `swarm.cli:main`).
- options.py         - options generated from the role configs, grouped --help, exit statuses.
- peer_commands.py   - `swarm bootstrap`, `learner`, `sampler`, `status`.
- local_commands.py  - `swarm eval`, `swarm demo`.
- dashboard.py       - `swarm dashboard`: the live web view (swarm/dashboard/) of a swarm.
- demo.py            - the demo: a local swarm with a live view read from the peers' files, or the
                       in-process trainer; accuracy before and after.
- launcher.py        - starts peers as processes on loopback and reads their ready files.
- plots.py           - PNG plots of a run.
"""

from swarm.cli.app import main

__all__ = ["main"]
