"""A weight holder or a weight fetcher as its own process, for the WAN tests of relaying
(tests/wan/test_wan_relay.py): the library's fabric, version store, weight server and fetch, without a
model, so that a test controls who holds what and can kill a holder mid-transfer.

    python tests/helpers/wan_weights.py serve --transport T --peers ADDR --out DIR [--megabytes N] [--corrupt] [--announce]
    python tests/helpers/wan_weights.py fetch --transport T --peers ADDR --holders P1,P2 --hash H --out FILE
    python tests/helpers/wan_weights.py follow --transport T --peers ADDR --key KEY --out DIR [--corrupt]

`serve` holds version 0 (the same tensors in every holder: seeded), serves it, and writes
DIR/ready.json with its peer id, its learner key and the version's hash; with --corrupt it serves
a copy with one byte changed; with --announce it announces version 0 as a learner does, chunked,
once the file DIR/go exists.
`fetch` asks the holders in order (the product's fetch_from_holders) and writes what it got to
FILE. `follow` is a sampler's version follower and heartbeat (a relay: it serves the chunks it
receives) that writes DIR/fetched.json once it holds version 0, and DIR/shunned.json when stopped;
with --corrupt, or once the file DIR/corrupt exists, it serves every chunk with its first byte flipped.
"""

from __future__ import annotations

import argparse
import os
import random
import threading
import time
from pathlib import Path

import torch

from swarm.fabric.weights.chunks import ChunkFeed
from swarm.fabric.weights.follower import VersionFollower, fetch_from_holders
from swarm.config.learner_keys import decode_learner_key, encode_learner_key
from swarm.fabric.membership.pulse import Pulse
from swarm.fabric.membership.records import Heartbeat
from swarm.fabric.transports import join
from swarm.fabric.weights.versions import VersionStore
from swarm.runlog import write_json_atomic
from swarm.signals import install_stop_signals
from swarm.staleness import SecondsDelay


def version_zero(megabytes: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    n = int(megabytes * 1e6 / 4 / 4)
    return {f"layer{i}.weight": torch.randn(n, generator=gen) for i in range(4)}


def serve(args) -> None:
    fabric = join(args.transport, run_id=args.run_id, peers=[args.peers], role="holder", host="0.0.0.0")
    store = VersionStore()
    digest = store.add(0, version_zero(args.megabytes))
    if args.corrupt:
        honest = store.payloads

        def tampered(have, want):
            payload = bytearray(honest(None, want)[0])
            payload[len(payload) // 2] ^= 0x01  # one bit in the middle of a tensor
            return [bytes(payload)]

        store.payloads = tampered
    server = fabric.weight_server(store)
    out = Path(args.out)

    def announce() -> None:
        if (out / "go").exists():
            fabric.announce(0, digest, chunks=store.chunk_specs(0))

    pulse = Pulse(announce, 0.5) if args.announce else None
    write_json_atomic(out / "ready.json", {"peer_id": fabric.peer_id, "hash": digest, "pid": os.getpid(),
                                           "key": encode_learner_key(fabric.public_key)})
    wait_stopped()
    if pulse is not None:
        pulse.close()
    write_json_atomic(out / "served.json", {"served": server.served, "bytes": server.bytes_served})
    server.close()
    fabric.shutdown()


def wait_stopped() -> None:
    """Until SIGTERM. The wait wakes every 0.2 s: a signal the kernel hands to another thread
    sets the event only once the main thread runs Python again, which a wait without a time-out
    may never do."""
    stop = threading.Event()
    install_stop_signals(stop)
    while not stop.wait(0.2):
        pass


def corrupting(lookup, hostile=lambda: True):
    """A ChunkBook.lookup that answers every chunk with its first byte flipped (a hostile relay),
    while `hostile()`: a chunk still arriving here (a ChunkFeed, cut-through) is taken whole, then
    tampered with."""

    def tampered(kind, version, root, index, wait_s):
        data = lookup(kind, version, root, index, wait_s)
        if not hostile():
            return data
        if isinstance(data, ChunkFeed):
            data = b"".join(iter(lambda: data.next(30.0), None))
        return data if data is None or index is None else bytes([data[0] ^ 0xFF]) + data[1:]

    return tampered


def follow(args) -> None:
    fabric = join(args.transport, run_id=args.run_id, peers=[args.peers], role="sampler", host="0.0.0.0")
    store = VersionStore()
    out = Path(args.out)
    # hostile from the start (--corrupt), or once the test touches DIR/corrupt (it picks the liar
    # by the peer ids the followers wrote, so that the liar heads their chain)
    store.book.lookup = corrupting(store.book.lookup, lambda: args.corrupt or (out / "corrupt").exists())
    server = fabric.weight_server(store)

    def beat() -> None:
        with store.lock:
            holds = tuple(store.states)
        fabric.heartbeat(Heartbeat(role="sampler", version=max(holds, default=0), holds=holds, relay=True))

    def fetched(result) -> None:
        write_json_atomic(out / "fetched.json", {**result.event_fields(), "hash": store.hashes[result.version]})
        pulse.poke()

    pulse = Pulse(beat, 1.0)
    follower = VersionFollower(fabric, store, [decode_learner_key(args.key)], SecondsDelay.parse("none"),
                               random.Random(fabric.peer_id), echo=print, on_fetch=fetched, poll_s=0.25)
    write_json_atomic(out / "ready.json", {"peer_id": fabric.peer_id, "pid": os.getpid()})
    wait_stopped()
    write_json_atomic(out / "shunned.json", follower.shunned())  # a copy: the follower may still be shunning
    follower.close()
    pulse.close()
    server.close()
    fabric.shutdown()


def fetch(args) -> None:
    fabric = join(args.transport, run_id=args.run_id, peers=[args.peers], role="fetcher", host="0.0.0.0")
    client = fabric.weight_client()
    store = VersionStore()
    corrupt = []
    started = time.time()
    try:
        result = fetch_from_holders(client, args.holders.split(","), 0, args.hash, store, fabric.unreachable_errors(),
                                    on_corrupt=lambda holder, exc: corrupt.append(holder))
        found = {"holder": result.holder, "bytes": result.bytes, "seconds": result.seconds, "hash": store.hashes[0]}
    except Exception as exc:  # noqa: BLE001  the test reads what went wrong
        found = {"error": f"{type(exc).__name__}: {exc}"}
    found.update(corrupt=corrupt, total_seconds=time.time() - started)
    write_json_atomic(Path(args.out), found)
    client.close()
    fabric.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["serve", "fetch", "follow"])
    parser.add_argument("--transport", default="hivemind")
    parser.add_argument("--peers", required=True)
    parser.add_argument("--run-id", default="wan-relay")
    parser.add_argument("--out", required=True)
    parser.add_argument("--megabytes", type=float, default=2.0)
    parser.add_argument("--corrupt", action="store_true")
    parser.add_argument("--holders", default="")
    parser.add_argument("--hash", default="")
    parser.add_argument("--announce", action="store_true")
    parser.add_argument("--key", default="")
    args = parser.parse_args()
    {"serve": serve, "fetch": fetch, "follow": follow}[args.mode](args)


if __name__ == "__main__":
    main()
