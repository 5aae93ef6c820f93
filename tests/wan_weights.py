"""A weight holder or a weight fetcher as its own process, for the WAN tests of relaying
(tests/test_wan_relay.py): the library's fabric, version store, weight server and fetch, without a
model, so that a test controls who holds what and can kill a holder mid-transfer.

    python tests/wan_weights.py serve --transport T --peers ADDR --out DIR [--megabytes N] [--corrupt]
    python tests/wan_weights.py fetch --transport T --peers ADDR --holders P1,P2 --hash H --out FILE

`serve` holds version 0 (the same tensors in every holder: seeded), serves it, and writes
DIR/ready.json with its peer id and the version's hash; with --corrupt it serves a copy with one
byte changed. `fetch` asks the holders in order (the product's fetch_from_holders) and writes what
it got to FILE.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path

import torch

from swarm.fabric.follower import fetch_from_holders
from swarm.fabric.transports import join
from swarm.fabric.versions import VersionStore
from swarm.runlog import write_json_atomic


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
    write_json_atomic(out / "ready.json", {"peer_id": fabric.peer_id, "hash": digest, "pid": os.getpid()})
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    write_json_atomic(out / "served.json", {"served": server.served})
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
    parser.add_argument("mode", choices=["serve", "fetch"])
    parser.add_argument("--transport", default="hivemind")
    parser.add_argument("--peers", required=True)
    parser.add_argument("--run-id", default="wan-relay")
    parser.add_argument("--out", required=True)
    parser.add_argument("--megabytes", type=float, default=2.0)
    parser.add_argument("--corrupt", action="store_true")
    parser.add_argument("--holders", default="")
    parser.add_argument("--hash", default="")
    args = parser.parse_args()
    serve(args) if args.mode == "serve" else fetch(args)


if __name__ == "__main__":
    main()
