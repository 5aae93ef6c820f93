"""The fabric over hivemind: a DHT for records, libp2p streams for rollouts and weights.
Imported only through swarm.fabric.transports (hivemind is heavy: it pulls in torch).

- fabric.py        - `HivemindFabric` and `HivemindBootstrap`.
- dht.py           - a DHT node with the swarm's validators; the p2p daemon's lifetime.
- records.py       - membership records, version announcements, revocations in the DHT: where each lives.
- record_rules.py  - `OwnerRules`: one record per owner key, each in its own place.
- loop.py          - a private asyncio loop per component for the p2p streams.
- weights.py       - `WeightServer` and `WeightClient` over p2p streams.
- rollouts.py      - `RolloutInbox` and `RolloutSender` over p2p streams.
- learner_group.py - several learners averaging gradients through hivemind's averager.
"""
