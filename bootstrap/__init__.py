"""The bootstrap node (`swarm bootstrap`), a peer of the middle layer.

- node.py - start the node peers join through (a DHT node, or the gRPC registry), write its
            addresses to the run directory's ready.json, and record a status line every minute
            until stopped.
"""
