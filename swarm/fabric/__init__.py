"""The swarm fabric: how peers find each other, what they announce, and how rollouts and weights
move between them.

- identity.py          - persistent keys: the libp2p identity (stable peer id / multiaddr), the
                         RSA key that signs a peer's DHT records.
- records.py           - membership records under a run id: schema, signing, heartbeat, listing.
- dht.py               - start a hivemind DHT node with the swarm's record validators.
- loop.py              - a private asyncio loop per component, and p2p clients bound to it.
- wire.py              - the rollout-group wire format (msgpack) with bounds and validation.
- rollout_exchange.py  - samplers stream rollout groups to a learner's inbox (at most once,
                         with backpressure and per-peer refusal counts).
- weight_delta.py      - policy versions as bit-exact deltas against the previous version.
- versions.py          - signed version announcements (learner keys only), a store of held
                         versions, and serving / fetching them between any holders (relay).
"""
