"""The bootstrap node: the hivemind DHT entry point peers join through (`swarm bootstrap`).

Part of the swarm fabric, which is not built yet; this package holds its place in the layout.
"""
