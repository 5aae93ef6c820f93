"""The bootstrap node: the hivemind DHT entry point peers join through (`swarm bootstrap`).

- node.py - start a DHT node with a persistent identity, print the multiaddrs to pass to
            `--peers`, and log a status line per minute until stopped.
"""
