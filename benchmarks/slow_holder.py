"""A joining peer's snapshot with a slow holder in the swarm (issue 45, point 4), over each transport,
on loopback: another peer (its own process, tests/helpers/hostile_holder.py) took every chunk of the
snapshot from the learner as a relaying peer, so the learner sends the joining peer to it for those
chunks. Honest, it serves them at full speed ("take"); hostile, it serves valid bytes slowly, 512
bytes every 0.1 s ("slow"). The joining peer judges the peers it is sent to by their rate against
the learner's (source_judging.SLOW_RATIO) and strikes a slow one. Figures: the joining peer's time
with the hostile peer / with the honest one (goal: within 2x), and the learner's copies in each.

GEPO_SLOW_HOLDER_MB (default 32), GEPO_SLOW_HOLDER_REPEATS (3), GEPO_SLOW_HOLDER_TRANSPORTS
(hivemind,grpc). Runs alternate honest and hostile, so that load on the machine falls on both."""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import markdown_table, write_result
from benchmarks.fanout import model_state

HELPER = Path(__file__).parents[1] / "tests" / "helpers" / "hostile_holder.py"
RUN = "slow-holder-bench"


def one_fetch(transport: str, state, mode: str) -> dict:
    from swarm.fabric.local import LocalFabrics
    from swarm.fabric.weights.chunked_fetch import ChunkedFetch, ChunkSources
    from swarm.fabric.weights.versions import VersionStore

    with LocalFabrics(transport, RUN) as fabrics:
        learner = fabrics.make()
        store = VersionStore()
        server = learner.weight_server(store)
        store.add(0, state)
        specs = store.chunk_specs(0)
        spec = next(s for s in specs if s.kind == "snapshot")
        learner.announce(0, store.hashes[0], recent=dict(store.hashes), chunks=specs)
        proc = subprocess.Popen([sys.executable, str(HELPER), "--transport", transport, "--peers",
                                 ",".join(fabrics.bootstrap.addresses()), "--run-id", RUN, "--learner-key",
                                 learner.public_key.hex(), "--mode", mode], stdout=subprocess.PIPE, text=True)
        try:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the {mode} holder did not start")
            joining = fabrics.make()
            served_before = server.bytes_served
            fetch = ChunkedFetch(joining.weight_client(), VersionStore().book, spec,
                                 ChunkSources([learner.peer_id], [joining.peer_id]), joining.peer_id,
                                 unreachable=joining.unreachable_errors(), on_corrupt=lambda p, e: None,
                                 rng=random.Random(0))
            started = time.monotonic()
            partial = fetch.run()
            took = time.monotonic() - started
            assert partial.payload() == store.payload("snapshot", 0)
            time.sleep(0.2)  # the learner counts a chunk's bytes once sent
            fetch.client.close()
            return {"seconds": took, "learner_copies": (server.bytes_served - served_before) / spec.size,
                    "from_holder_mb": sum(n for p, n in fetch.received.items() if p != learner.peer_id) / 1e6,
                    "struck": len(fetch.slow), "chunks": spec.count, "size_mb": spec.size / 1e6}
        finally:
            proc.kill()
            proc.wait(10)
            server.close()


def run() -> None:
    megabytes = int(os.environ.get("GEPO_SLOW_HOLDER_MB", "32"))
    repeats = int(os.environ.get("GEPO_SLOW_HOLDER_REPEATS", "3"))
    transports = os.environ.get("GEPO_SLOW_HOLDER_TRANSPORTS", "hivemind,grpc").split(",")
    state = model_state(megabytes)
    load = os.getloadavg()
    figures, rows = {"megabytes": megabytes, "repeats": repeats, "load_before": load}, []
    for transport in transports:
        runs = {"take": [], "slow": []}
        for _ in range(repeats):
            for mode in runs:
                runs[mode].append(one_fetch(transport, state, mode))
        honest = statistics.median(r["seconds"] for r in runs["take"])
        hostile = statistics.median(r["seconds"] for r in runs["slow"])
        figures[transport] = {**runs, "ratio": hostile / honest}
        rows.append([transport, f"{runs['take'][0]['size_mb']:.1f} MB in {runs['take'][0]['chunks']} chunks",
                     honest, hostile, hostile / honest, statistics.median(r["learner_copies"] for r in runs["take"]),
                     statistics.median(r["learner_copies"] for r in runs["slow"]),
                     statistics.median(r["from_holder_mb"] for r in runs["slow"]),
                     f"{sum(r['struck'] for r in runs['slow'])} of {repeats}"])
    figures["load_after"] = os.getloadavg()
    markdown = ("# A joining peer's snapshot with a slow holder (issue 45.4)\n\n"
                f"Median of {repeats} runs each, loopback; load average before {load[0]:.1f}, after "
                f"{figures['load_after'][0]:.1f} on {os.cpu_count()} cores (a machine shared with other work: the "
                "ratio is what counts). Goal: hostile within 2x honest.\n\n"
                + markdown_table(["transport", "snapshot", "honest taker s", "slow taker s", "x honest",
                                  "learner copies, honest", "learner copies, slow", "MB from the slow taker",
                                  "slow taker struck"], rows))
    write_result(f"slow_holder_{megabytes}mb", figures, markdown)
