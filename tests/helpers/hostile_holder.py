"""A hostile peer, run as its own process by tests/fabric/weights/test_hostile_holders.py and
benchmarks/slow_holder.py, built from the project's own fabric code. Two modes:

--mode record: keeps a signed membership record in the swarm whose peer id is not a peer id (not
base58 over hivemind; no address over gRPC), that relays and lists the next versions as held
(issue 45, point 3).

--mode take: the same, served at full speed (an honest taker: the baseline of
benchmarks/slow_holder.py).

--mode slow: fetches the snapshot of the newest announced version in chunks from the learner as a
relaying peer, so that the learner sends later requesters of those chunks here, then serves them
slowly: valid bytes, SLOW_PIECE bytes every SLOW_PAUSE_S (issue 45, point 4).

--mode stall: fetches the newest announced version whole from the learner, lists it as held in
its relaying record, and answers every whole-version request by stalling: it takes the request
and never sends a byte (the whole-version fallback's worst relay: issue 45, round two).

It prints "ready" once it is in place, then stays until killed."""

import argparse
import sys
import time

SLOW_PIECE = 512
SLOW_PAUSE_S = 0.1
STALL_S = 3600.0  # how long a stalling relay keeps a whole-version request waiting


class SlowFeed:
    """A chunk's bytes, given a few at a time (the weight servers send what `next` gives them)."""

    def __init__(self, data: bytes, piece: int, pause_s: float) -> None:
        self.data, self.piece, self.pause_s, self.sent = bytes(data), piece, pause_s, 0

    def __len__(self) -> int:
        return len(self.data)

    def next(self, timeout: float) -> bytes | None:
        if self.sent >= len(self.data):
            return None
        time.sleep(self.pause_s)
        piece = self.data[self.sent:self.sent + self.piece]
        self.sent += len(piece)
        return piece


def slow_lookup(lookup, piece: int, pause_s: float):
    """`lookup` (ChunkBook.lookup) whose chunks come as a SlowFeed (a ChunkFeed to the servers)."""
    from swarm.fabric.weights.chunks import ChunkFeed

    class Slow(SlowFeed, ChunkFeed):
        pass

    def slowly(kind, version, root, index, wait_s):
        found = lookup(kind, version, root, index, wait_s)
        if index is None or found is None:
            return found
        if isinstance(found, ChunkFeed):
            parts = []
            while (part := found.next(30.0)) is not None:
                parts.append(part)
            found = b"".join(parts)
        return Slow(found, piece, pause_s)
    return slowly


def poison_record(fabric, transport: str, run_id: str, newest: int) -> None:
    from swarm.fabric.membership.records import MAX_HOLDS_LISTED, Heartbeat, members_key

    beat = Heartbeat(role="sampler", version=newest, holds=tuple(range(newest, newest + MAX_HOLDS_LISTED)),
                     relay=True)
    if transport == "hivemind":
        now = fabric.now()
        fabric.dht.store(members_key(run_id, fabric.public_key), subkey=fabric.public_key, value=beat.record("0OIl-not-base58!", now).dict(),
                         expiration_time=now + 3)
    else:
        from swarm.fabric.grpc.common import RequestSigner

        fabric.server.address = "not an address"
        fabric.signer = RequestSigner(fabric.signing_key, run_id, fabric.peer_id)
        fabric.heartbeat(beat)


def stall(fabric, store, ann) -> None:
    """Hold `ann`'s version, list it as held, and stall every whole-version request for it."""
    from swarm.fabric.membership.records import Heartbeat

    fabric.weight_client().fetch(ann.peer_id, ann.version, ann.hash, store)

    def stalled(have, want):
        time.sleep(STALL_S)  # the request is taken (an upload slot and all), and nothing is sent
        raise KeyError("stalled")

    store.payloads = stalled
    beat = Heartbeat(role="sampler", version=ann.version, holds=(ann.version,), relay=True)
    assert fabric.heartbeat(beat)
    print("ready", flush=True)
    while True:
        time.sleep(1.0)
        fabric.heartbeat(beat)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", required=True)
    parser.add_argument("--peers", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--learner-key", required=True, help="hex of the learner's public key")
    parser.add_argument("--mode", choices=("record", "take", "slow", "stall"), required=True)
    parser.add_argument("--piece", type=int, default=SLOW_PIECE)
    parser.add_argument("--pause", type=float, default=SLOW_PAUSE_S)
    args = parser.parse_args()

    from swarm.fabric.transports import join
    from swarm.fabric.weights.chunked_fetch import ChunkedFetch, ChunkSources
    from swarm.fabric.weights.versions import VersionStore

    fabric = join(args.transport, run_id=args.run_id, peers=args.peers.split(","), role="sampler", heartbeat_s=1.0)
    key = bytes.fromhex(args.learner_key)
    ann = None
    while ann is None:
        ann = fabric.latest_announced([key])
        if ann is None:
            time.sleep(0.2)
    if args.mode == "record":
        print("ready", flush=True)
        while True:
            newest = fabric.latest_announced([key])
            poison_record(fabric, args.transport, args.run_id, newest.version if newest else ann.version)
            time.sleep(0.5)
    store = VersionStore()
    server = fabric.weight_server(store)
    if args.mode == "stall":
        stall(fabric, store, ann)
        return
    spec = ann.chunks["snapshot"]
    me = fabric.peer_id
    fetch = ChunkedFetch(fabric.weight_client(), store.book, spec, ChunkSources([ann.peer_id], [me]), me,
                         unreachable=fabric.unreachable_errors(), on_corrupt=lambda peer, exc: None)
    fetch.run()  # every chunk taken from the learner as a relaying peer, and still served from here
    if args.mode == "slow":
        store.book.lookup = slow_lookup(store.book.lookup, args.piece, args.pause)
    print("ready", flush=True)
    try:
        while True:
            time.sleep(1.0)
    finally:
        server.close()


if __name__ == "__main__":
    sys.exit(main())
