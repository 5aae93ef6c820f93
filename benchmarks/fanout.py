"""Time for one policy version of a ~100 MB model to reach 1, 2, 4 and 8 receivers on loopback,
over each transport, two ways:

- relay: every receiver fetches from the least-busy peer that already holds the version (the
  learner or a receiver that finished), at most `SLOTS` uploads per holder at a time, as samplers
  do; the learner's upload stays bounded;
- direct: every receiver fetches from the learner at once (no relay), for comparison.

The version travels as a full snapshot (the case of a new or far-behind peer; a delta is smaller),
is rebuilt and its hash checked by every receiver. All peers share this machine's cores, so on
loopback the total work (copies, hashing) grows with the receivers whatever the topology; what
relay bounds is the learner's upload, reported as bytes it served.
"""

from __future__ import annotations

import threading
import time

import torch

from benchmarks.common import markdown_table, write_result

SLOTS = 2
RECEIVERS = (1, 2, 4, 8)


def model_state(megabytes: int = 100) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    elements = megabytes * 1024 * 1024 // 2  # bf16
    per = 2 * 1024 * 1024
    return {f"layer{i}.weight": torch.randn(per).to(torch.bfloat16) for i in range(elements // per)}


class _Holders:
    """Who holds the version and how many uploads each is serving."""

    def __init__(self, learner) -> None:
        self.cond = threading.Condition()
        self.holders = {learner.peer_id: 0}

    def acquire(self, relay: bool, learner_id: str) -> str:
        with self.cond:
            while True:
                pool = self.holders if relay else {learner_id: self.holders[learner_id]}
                free = [(busy, peer) for peer, busy in pool.items() if busy < SLOTS or not relay]
                if free:
                    _, peer = min(free)
                    self.holders[peer] += 1
                    return peer
                self.cond.wait()

    def release(self, peer: str, new_holder: str | None) -> None:
        with self.cond:
            self.holders[peer] -= 1
            if new_holder is not None:
                self.holders[new_holder] = 0
            self.cond.notify_all()


def fan_out(transport: str, receivers: int, relay: bool, state: dict) -> dict:
    from swarm.fabric.local import LocalFabrics
    from swarm.fabric.weights.versions import VersionStore

    with LocalFabrics(transport, f"fanout-{transport}") as fabrics:
        learner = fabrics.make()
        store = VersionStore(capacity=2)
        digest = store.add(0, state)
        servers = {learner.peer_id: learner.weight_server(store)}
        store.payloads(None, 0)  # encode the snapshot once before timing (the learner would have)
        peers = []
        for _ in range(receivers):
            fabric = fabrics.make()
            peer_store = VersionStore(capacity=2)
            servers[fabric.peer_id] = fabric.weight_server(peer_store)
            peers.append((fabric, peer_store, fabric.weight_client(timeout_s=600)))
        holders = _Holders(learner)
        served_by_learner = [0]
        errors: list[BaseException] = []

        def receive(fabric, peer_store, client) -> None:
            try:
                source = holders.acquire(relay, learner.peer_id)
                try:
                    client.fetch(source, 0, digest, peer_store)
                    peer_store.payloads(None, 0)  # ready to relay: its snapshot is encoded
                finally:
                    holders.release(source, fabric.peer_id if peer_store.latest == 0 else None)
                if source == learner.peer_id:
                    served_by_learner[0] += 1
            except BaseException as exc:  # noqa: BLE001  reported after the run
                errors.append(exc)

        threads = [threading.Thread(target=receive, args=peer) for peer in peers]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - started
        if errors:
            raise errors[0]
        assert all(s.hashes.get(0) == digest for _, s, _ in peers)
        for _, _, client in peers:
            client.close()
        for server in servers.values():
            server.close()
    return {"transport": transport, "receivers": receivers, "relay": relay, "seconds": elapsed,
            "learner_uploads": served_by_learner[0]}


def run() -> dict:
    state = model_state()
    snapshot_mb = sum(t.numel() * 2 for t in state.values()) / 2**20
    rows = []
    for transport in ("hivemind", "grpc"):
        for relay in (True, False):
            for n in RECEIVERS:
                rows.append(fan_out(transport, n, relay, state))
                print(f"  {transport} relay={relay} receivers={n}: {rows[-1]['seconds']:.2f}s", flush=True)
    base = {(r["transport"], r["relay"]): r["seconds"] for r in rows if r["receivers"] == 1}
    for r in rows:
        r["vs_one_receiver"] = r["seconds"] / base[(r["transport"], r["relay"])]
    figures = {"version_megabytes": snapshot_mb, "upload_slots_per_holder": SLOTS, "rows": rows}
    md = (f"# Fan-out of one policy version ({snapshot_mb:.0f} MB snapshot, bf16) on loopback\n\n"
          "Each receiver rebuilds the version and checks its hash. relay: fetch from the least-busy holder "
          f"(at most {SLOTS} uploads per holder); direct: everyone from the learner.\n\n" + markdown_table(
              ["transport", "mode", "receivers", "seconds", "x time of 1 receiver", "learner uploads"],
              [[r["transport"], "relay" if r["relay"] else "direct", r["receivers"], r["seconds"], r["vs_one_receiver"],
                r["learner_uploads"]] for r in rows]))
    write_result("fanout", figures, md)
    return figures
