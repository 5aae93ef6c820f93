"""The gRPC fallback transport, for where libp2p's daemon cannot run. Imported only through
swarm.fabric.transports.

- common.py   - framing, channel and server options, signed requests (checked before a call gets a
                thread: SignedService), the watchdog.
- tls.py      - TLS certificates made from peers' signing keys, pinned by key id.
- registry.py - the registry a gRPC swarm joins through (`GrpcBootstrap`).
- server.py   - a peer's own server (`GrpcPeerServer`), its method paths, the pool of channels.
- fabric.py   - `GrpcFabric`.
- weights.py  - its weight server and client.
- rollouts.py - its rollout inbox and sender.
"""
