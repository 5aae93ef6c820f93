"""Where a learner encodes the newest version's whole snapshot (what new samplers fetch in chunks),
and what that costs its training thread: in the learner's process (the store's own encode_snapshot,
from the heartbeat's thread, as before issue 44's leftover) or in the publisher's encoding process
(Publisher(isolation="process"): VersionStore.snapshot_encoder, a process of its own started at
the first snapshot, not timed). Byte for byte the same payload.

The training thread is modelled as publish_overlap.py's launch_bound case does: a Python loop of
small torch ops (GEPO_SNAPSHOT_OFFLOAD_OPS, 3,000 a step, on 64-element tensors, one torch thread),
each needing the GIL as a GPU step's kernel launches do. While a snapshot of a bf16 state of
GEPO_SNAPSHOT_OFFLOAD_ELEMENTS (150 M, ~300 MB) is encoded, its steps are timed; the median step
with nothing encoded ("idle") is the baseline, each mode alternating in rounds, in this one process.
The training thread is pinned to one CPU and the encoder (the thread, the encoding process) to the
others where there are two or more (GEPO_SNAPSHOT_OFFLOAD_PIN=0: not), as on a GPU learner with
idle cores: what is left is the GIL (and memory bandwidth).

`python -m benchmarks snapshot_offload` (GEPO_SNAPSHOT_OFFLOAD_ROUNDS=3)
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import torch

from benchmarks.common import markdown_table, write_result


def run() -> dict:
    from swarm.fabric.weights.delta import encode_snapshot
    from swarm.fabric.weights.publisher import Publisher
    from swarm.fabric.weights.versions import VersionStore

    ops = int(os.environ.get("GEPO_SNAPSHOT_OFFLOAD_OPS", 3000))
    elements = int(float(os.environ.get("GEPO_SNAPSHOT_OFFLOAD_ELEMENTS", 150e6)))
    rounds = int(os.environ.get("GEPO_SNAPSHOT_OFFLOAD_ROUNDS", 3))
    load_before = os.getloadavg()[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    state = {f"layer.{i}.weight": (torch.randn(elements // 8, generator=gen) * 0.02).to(torch.bfloat16) for i in range(8)}
    store = VersionStore(capacity=4, whole_states=1)
    publisher = Publisher(store, on_published=lambda v, d: None, isolation="process")
    publisher.publish_now(0, state)
    del state
    child_encoder = store.snapshot_encoder
    x = torch.ones(64)

    def step() -> float:
        started = time.perf_counter()
        y = x
        for _ in range(ops // 2):
            y = y * 1.0001
            y = y + 0.0001
        return time.perf_counter() - started

    encoder_thread_cpus: list[int] = []
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
    pinned = os.environ.get("GEPO_SNAPSHOT_OFFLOAD_PIN", "1") == "1" and len(cpus) >= 2
    assert store.payload("snapshot", 0) is not None  # starts the snapshot-encoding process (not timed)
    if pinned:
        os.sched_setaffinity(publisher.snapshot_encoder_pid, cpus[1:])
        encoder_thread_cpus = cpus[1:]

    def encode(mode: str, out: dict) -> None:
        if encoder_thread_cpus:
            os.sched_setaffinity(0, encoder_thread_cpus)  # (Linux: this thread only; the codec's threads inherit it)
        store._snapshot = None
        store.snapshot_encoder = child_encoder if mode == "process" else None
        started = time.perf_counter()
        out["payload"] = store.payload("snapshot", 0)
        out["seconds"] = time.perf_counter() - started

    steps: dict[str, list[float]] = {"idle": [], "here": [], "process": []}
    encode_s: dict[str, list[float]] = {"here": [], "process": []}
    payloads: dict[str, bytes] = {}
    try:
        if pinned:
            os.sched_setaffinity(0, cpus[:1])  # the training thread
        for _ in range(rounds):
            for mode in ("idle", "here", "process"):
                if mode == "idle":
                    steps[mode] += [step() for _ in range(20)]
                    continue
                out: dict = {}
                worker = threading.Thread(target=encode, args=(mode, out), name=f"snapshot-{mode}")
                worker.start()
                while worker.is_alive():
                    steps[mode].append(step())
                worker.join()
                encode_s[mode].append(out["seconds"])
                payloads[mode] = out["payload"]
                del out
        reference = encode_snapshot(store.states[0], 0)
        identical = payloads["here"] == payloads["process"] == reference
    finally:
        if pinned:
            os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)
        store.snapshot_encoder = None
        publisher.close()
    load_after = os.getloadavg()[0]
    median = {mode: statistics.median(t) for mode, t in steps.items()}
    figures = {
        "elements": elements, "snapshot_bytes": len(reference), "ops_per_step": ops, "rounds": rounds, "pinned": pinned,
        "median_step_seconds": {m: round(s, 5) for m, s in median.items()},
        "step_over_idle": {m: round(s / median["idle"], 3) for m, s in median.items()},
        "steps_measured": {m: len(t) for m, t in steps.items()},
        # what the encoding cost the training thread in all: its steps' time past idle ones, a snapshot
        "training_delay_seconds_per_snapshot": {m: round((sum(steps[m]) - len(steps[m]) * median["idle"]) / rounds, 3)
                                                for m in ("here", "process")},
        "encode_seconds_median": {m: round(statistics.median(t), 2) for m, t in encode_s.items()},
        "byte_identical": identical, "load_average": [round(load_before, 2), round(load_after, 2)], "cpus": os.cpu_count(),
        "busy": load_before > 1.5 or load_after > 1.5,
    }
    markdown = (f"# Snapshot encoding: the learner's process or the encoding process\n\n{__doc__.strip()}\n\n"
                + markdown_table(["measure", "in the learner's process", "in the encoding process"], [
                    ["training-thread step while a snapshot is encoded, over idle", figures["step_over_idle"]["here"],
                     figures["step_over_idle"]["process"]],
                    ["... the training thread's delay in all, a snapshot, s", figures["training_delay_seconds_per_snapshot"]["here"],
                     figures["training_delay_seconds_per_snapshot"]["process"]],
                    ["snapshot encoded (the asking thread's wait), median s", figures["encode_seconds_median"]["here"],
                     figures["encode_seconds_median"]["process"]],
                    ["payload byte for byte the same as encode_snapshot's", identical, identical],
                ])
                + f"\nSnapshot of {len(reference) / 1e6:.0f} MB; idle step {median['idle'] * 1e3:.1f} ms; pinned: {pinned}. "
                + f"Load average before/after: {figures['load_average']} on {os.cpu_count()} CPUs"
                + (" (the machine was busy with other work: timings are disturbed)" if figures["busy"] else "") + "\n")
    write_result("snapshot_offload", figures, markdown)
    return figures
