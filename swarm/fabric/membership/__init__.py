"""Who is in a swarm and who may speak for a run.

- records.py    - membership records: a peer's `Heartbeat`, the schema-checked `MemberRecord`, refusals.
- identity.py   - persistent keys: the libp2p identity (stable peer id / multiaddr), the RSA key
                  that signs a peer's records.
- authority.py  - the run owner's certificates for other learners' keys.
- addresses.py  - which of this machine's addresses to tell other peers, and in which order.
- pulse.py      - a peer's heartbeat on its own schedule.
- link_judge.py - which samplers' links are slow, judged from the fetches their heartbeats report.
"""
