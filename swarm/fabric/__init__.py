"""The swarm fabric: how peers find each other, what they announce, and how rollouts and weights
move between them. One written interface, two transports.

- interface.py          - the interface every transport implements (`Fabric`, `BootstrapNode`,
                          inbox, sender, weight server and client) and `JoinError`.
- transports.py         - the one place a transport is chosen: join, observe, start a bootstrap node.
- identity.py           - persistent keys: the libp2p identity (stable peer id / multiaddr), the
                          RSA key that signs a peer's records, learner keys as `--learner-key` text.
- records.py            - membership records under a run id: schema, signing, heartbeat, listing.
- wire.py               - the rollout-group wire format (msgpack) with bounds and validation.
- bans.py               - temporary bans of peers that keep sending bad data.
- rollout_exchange.py   - a learner's inbox (validation, at-most-once delivery, backpressure,
                          bans) and the sender, over hivemind p2p streams.
- weight_delta.py       - policy versions as bit-exact deltas against the previous version;
                          varints.py, the varint and zigzag coding its streams use;
                          value_classes.py, the classes its changes are counted in;
                          packed_stream.py, its msgpack body streamed through zlib.
- versions.py           - signed version announcements (learner keys only), the store of the
                          versions a peer holds, serving them and rebuilding fetched ones.
- chunks.py, chunked_fetch.py - a version's payload in verifiable chunks, served while it
                          arrives, and fetched in stripes shared with the peers fetching it too.
- upload_slots.py       - how many transfers a holder serves at once, and who gets a freed slot.
- follower.py           - a sampler's background fetching of new versions (from other holders
                          first, the learner last) and the latency simulation's choice of
                          version.
- dht.py, loop.py       - hivemind: a DHT node with the swarm's validators; a private asyncio loop
                          per component for the p2p streams.
- hivemind_transport.py - `HivemindFabric` and `HivemindBootstrap`.
- grpc_common.py, grpc_registry.py, grpc_peer.py, grpc_weights.py - the gRPC fallback: framing
                          and signatures, the registry (`GrpcBootstrap`), `GrpcFabric`, and its
                          weight server and client.
- local.py              - a whole swarm of fabrics in one process, for tests and benchmarks.
"""
