"""What both sides of the gRPC fallback transport share: msgpack framing, channel and server
options, and the learner-key signatures (the same keys and `--learner-key` tokens as over hivemind).

The transport itself (see grpc_registry.py and grpc_peer.py):
- a **registry** (run by `swarm bootstrap --transport grpc`) holds membership records and version
  announcements in memory, with the same expiry as the DHT records. Each record is keyed by the
  peer's address and guarded by a per-peer token issued on its first heartbeat, so no peer can
  overwrite another's record until it has expired. Version announcements are signed with the
  learner's RSA key: the registry refuses bad signatures, and samplers verify them again against
  the keys they were given.
- every peer runs a gRPC **server** at `host:port` (its peer id here, and the address it tells
  others: give one they can reach) serving its rollout inbox (learners) and the versions it holds;
  rollouts stream from samplers to the learner and weights from the learner to samplers directly.

No protobuf code generation: methods are registered as generic handlers carrying msgpack bytes
(frames from wire.py for rollouts, weight_delta payloads for weights, cut into chunks).
"""


from __future__ import annotations

from concurrent import futures

import msgpack

SERVICE = "gepo_swarm.v1"
CHUNK_BYTES = 4 * 1024 * 1024  # weight payloads travel in chunks well under gRPC's message limits
MESSAGE_LIMIT = 64 * 1024 * 1024
REGISTRY_REQUEST_LIMIT = 1024 * 1024
PEER_HEADER = "x-swarm-peer"  # the sender's claimed address (gRPC has no peer authentication)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes):
    return msgpack.unpackb(data, raw=False)


def channel_options(limit: int = MESSAGE_LIMIT) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


def new_server(workers: int = 64, limit: int = MESSAGE_LIMIT):
    # one thread per open call: a learner's rollout streams block while its queue is full
    # (backpressure), so the pool must stay larger than the number of samplers streaming at once
    import grpc

    return grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"), options=channel_options(limit))


def bind(server, host: str, port: int) -> int:
    try:  # grpc returns 0 on a failed bind in older versions and raises RuntimeError in newer ones
        bound = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if not bound:
        raise OSError(f"could not listen on {host}:{port}; is the port in use?")
    return bound


def owner_key(private_key) -> bytes:
    """The `[owner:ssh-rsa ...]` form of a signing key's public half (as hivemind writes it)."""
    return b"[owner:" + private_key.get_public_key().to_bytes() + b"]"


def verify_owner_signature(owner: bytes, payload: bytes, signature: bytes) -> bool:
    from hivemind.utils.crypto import RSAPublicKey

    if not (owner.startswith(b"[owner:") and owner.endswith(b"]")):
        return False
    try:
        return RSAPublicKey.from_bytes(owner[len(b"[owner:"):-1]).verify(payload, signature)
    except Exception:  # noqa: BLE001  a key that does not parse verifies nothing
        return False
