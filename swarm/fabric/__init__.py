"""The swarm fabric: how peers find each other and what they announce.

- identity.py  - persistent keys: the libp2p identity (stable peer id / multiaddr) and the RSA
                 key that signs a peer's DHT records.
- records.py   - membership records under a run id: schema, signing, heartbeat, listing.
- dht.py       - start a hivemind DHT node with the swarm's record validators.
"""
