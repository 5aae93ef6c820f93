"""Rollout groups from samplers to a learner, whatever the transport.

- wire.py  - the rollout-group wire format (msgpack) with bounds and validation.
- inbox.py - `InboxCore`: a learner's inbox (validation, at-most-once delivery, backpressure,
             fair shares, stream limits, bans).
- bans.py  - temporary bans of peers that keep sending bad data.
"""
