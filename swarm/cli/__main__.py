"""`python -m swarm.cli`: the `swarm` command (the local launcher starts peers this way)."""

from swarm.cli.app import main

main()
