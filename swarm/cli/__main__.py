"""`python -m swarm.cli`: the `swarm` command (the local launcher starts peers this way)."""

from swarm.cli.app import main

if __name__ == "__main__":  # not when a child process re-imports this module
    main()
