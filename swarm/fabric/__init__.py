"""The swarm fabric: how peers find each other, what they announce, and how rollouts and weights
move between them. One written interface, two transports; each folder one concern, and imports
run one way (pyproject.toml's import contracts keep them so):

    local.py -> transports.py -> hivemind/ | grpc/ -> interface.py -> weights/ -> membership/ | rollouts/ -> signing.py

- interface.py  - the interface every transport implements (`Fabric`, `BootstrapNode`, inbox,
                  sender, weight server and client) and `JoinError`.
- transports.py - the one place a transport is chosen (and imported, lazily): join, observe,
                  start a bootstrap node.
- local.py      - a whole swarm of fabrics in one process, for tests and benchmarks.
- signing.py    - signatures and the `[owner:...]` public-key form, in one place.
- membership/   - records, identities, the run owner's authority, addresses, heartbeats, link judging.
- weights/      - the delta codec, versions, announcements, chunks, fetching and following versions.
- rollouts/     - the rollout wire format, the learner's inbox core, bans.
- hivemind/     - the transport over hivemind (DHT and libp2p streams).
- grpc/         - the fallback transport over gRPC.
"""
