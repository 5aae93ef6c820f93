"""One peer of the shaped-link fan-out benchmark (benchmarks/fanout_wan.py), as its own process in
a namespace of the WAN harness, using the product's fabric, version store, weight server,
follower (relay, busy holders, upload slots) and heartbeat.

    python -m benchmarks.fanout_peer learner  --peers ADDR --dir D --megabytes M --slots S [--deltas K]
    python -m benchmarks.fanout_peer receiver --peers ADDR --dir D --key KEY --slots S [--no-relay] [--stripes]

The learner holds version 0 (bfloat16 weights of about M MB, N(0, 0.02) like a trained model's);
version k >= 1 (up to K) is one signed step of 1e-4 on every weight of version k - 1, as AdamW
takes: in bfloat16 about half the weights move by one ulp, so each delta is about the size of a
real step's. It makes and announces version k when the file D/gok appears, and writes D/ready.json
and D/served.json (transfers it served). Every peer keeps the last STORE_CAPACITY versions (a delta
needs only the one before): several deltas in one run cost no more memory than one.
A receiver follows the learner's announcements and writes D/events.jsonl (each version fetched:
when, from whom, bytes, seconds).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import threading
import time
from pathlib import Path

import torch

from swarm.config import SwarmSettings, default_of
import swarm.fabric.weights.chunked_fetch as chunked_fetch
from swarm.fabric.weights.sharer_view import SharerView
from swarm.fabric.weights.follower import VersionFollower
from swarm.config.learner_keys import decode_learner_key, encode_learner_key
from swarm.fabric.membership.pulse import Pulse
from swarm.fabric.membership.records import Heartbeat
from swarm.fabric.transports import join
from swarm.fabric.weights.versions import VersionStore
from swarm.runlog import EventLog, write_json_atomic
from swarm.signals import install_stop_signals
from swarm.staleness import SecondsDelay

RUN_ID = "fanout"
# the product's period (a peer also beats at once after each fetch or announcement): every beat is
# a signed DHT store at every other node, CPU that 9 peers on this machine's 2 cores share
HEARTBEAT_S = default_of(SwarmSettings, "heartbeat_s")


STORE_CAPACITY = 3


def first_version(megabytes: float) -> dict:
    gen = torch.Generator().manual_seed(0)
    per = 1 << 20  # elements per tensor (2 MiB in bfloat16)
    count = max(1, int(megabytes * 1e6 / 2 / per))
    return {f"layer{i}.weight": (torch.randn(per, generator=gen) * 0.02).to(torch.bfloat16) for i in range(count)}


def stepped(state: dict, version: int) -> dict:
    """Version `version`: one signed step of 1e-4 on every weight of `state` (the one before)."""
    gen = torch.Generator().manual_seed(version)
    return {k: (t.float() - 1e-4 * torch.sign(torch.randn(t.numel(), generator=gen))).to(torch.bfloat16)
            for k, t in state.items()}


def stopping() -> threading.Event:
    stop = threading.Event()
    install_stop_signals(stop)
    return stop


def learner(args) -> None:
    stop = stopping()
    fabric = join(args.transport, run_id=RUN_ID, peers=[args.peers], role="learner", host="0.0.0.0",
                  upload_slots=args.slots or None)
    store = VersionStore(STORE_CAPACITY)
    announced: list[int] = []

    def beat() -> None:
        if announced:
            with store.lock:
                version = store.latest
                digest, holds, recent = store.hashes[version], tuple(store.states), dict(store.hashes)
            # as the learner peer does: the delta's spec at once, the snapshot's at the next beat once the
            # delta went out (the first version, which every receiver fetches as a snapshot, is announced with it)
            chunks = store.chunk_specs(version, quick=version > 0) if args.chunked else []
            fabric.announce(version, digest, recent=recent, chunks=chunks, sharers=sharers.announced(version, chunks))
            fabric.heartbeat(Heartbeat(role="learner", version=version, holds=holds))
            if args.chunked and store.snapshot_due(version):
                store.chunk_specs(version)
                pulse.poke()

    store.add(0, first_version(args.megabytes))
    sharers = SharerView(fabric)
    server = fabric.weight_server(store)
    pulse = Pulse(beat, HEARTBEAT_S)
    out = Path(args.dir)
    write_json_atomic(out / "ready.json", {"pid": os.getpid(), "peer_id": fabric.peer_id,
                                           "learner_key": encode_learner_key(fabric.public_key)})
    while not stop.wait(0.05):
        for version in range(args.deltas + 1):
            if version not in announced and (out / f"go{version}").exists():
                if version > 0:
                    with store.lock:
                        before = store.states[version - 1]
                    state = stepped(before, version)  # before the publish: not timed
                    sharers.publishing(version)  # as the learner peer does: who fetches the delta, looked up beside its encoding
                    store.add(version, state, owned=True)  # encodes the delta from the version before, as a publish does
                announced.append(version)
                write_json_atomic(out / f"announced{version}.json", {"time": time.time()})
                pulse.poke()
        write_json_atomic(out / "served.json", {"served": server.served, "busy": server.slots.refused,
                                                "bytes": server.bytes_served})
    pulse.close()
    sharers.close()
    server.close()
    fabric.shutdown()


def receiver(args) -> None:
    # its log (the benchmark's ROOT/logs/rN.log) tells which upstreams a chain peer probed and passed over
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("swarm.fabric.weights.upstream_pace").setLevel(logging.DEBUG)
    if args.stripes:
        chunked_fetch.CHAIN_MAX = 1  # any two sharers or more deal the chunks out in stripes
    stop = stopping()
    fabric = join(args.transport, run_id=RUN_ID, peers=[args.peers], role="receiver", host="0.0.0.0",
                  upload_slots=args.slots or None)
    store = VersionStore(STORE_CAPACITY)
    server = fabric.weight_server(store)
    events = EventLog(Path(args.dir))
    last = []  # the last fetch, which the heartbeat reports as the sampler peer's does (the learner orders chains by it)

    def beat() -> None:
        with store.lock:
            holds = tuple(store.states)
        fabric.heartbeat(Heartbeat(role="sampler", version=max(holds, default=0), holds=holds, relay=not args.no_relay,
                                   **(last[-1].heartbeat_fields() if last else {})))

    pulse = Pulse(beat, HEARTBEAT_S)

    def fetched(result) -> None:
        events.event("version_fetched", **result.event_fields())
        last[:] = [result]
        pulse.poke()

    follower = VersionFollower(fabric, store, [decode_learner_key(args.key)], SecondsDelay.parse("none"),
                               random.Random(fabric.peer_id), echo=print, on_fetch=fetched, relay=not args.no_relay,
                               chunked=args.chunked, poll_s=0.25)
    write_json_atomic(Path(args.dir) / "ready.json", {"pid": os.getpid(), "peer_id": fabric.peer_id})
    while not stop.wait(0.2):  # woken by SIGTERM whichever thread the kernel hands it to
        pass
    follower.close()
    pulse.close()
    server.close()
    events.close()
    fabric.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["learner", "receiver"])
    parser.add_argument("--transport", default="hivemind")
    parser.add_argument("--peers", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--megabytes", type=float, default=100.0)
    parser.add_argument("--slots", type=int, default=2, help="upload slots (0: no limit)")
    parser.add_argument("--deltas", type=int, default=1, help="versions after the first, each one step on the last")
    parser.add_argument("--key", default="")
    parser.add_argument("--no-relay", action="store_true")
    parser.add_argument("--chunked", action="store_true", help="announce (learner) and fetch (receiver) in chunks")
    parser.add_argument("--stripes", action="store_true", help="deal the chunks out in stripes, never along a chain")
    args = parser.parse_args()
    learner(args) if args.role == "learner" else receiver(args)


if __name__ == "__main__":
    main()
