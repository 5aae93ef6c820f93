"""Memory of a learner's rollout inbox under a flood of maximal groups, and what an honest sampler
gets through meanwhile.

The inbox runs in its own process (so its resident memory is measured alone), taking groups out at
20 groups/s as a learner does between steps. Three flooding peers, each with four concurrent
streams, send the largest valid groups the inbox's limits allow as fast as they can for
FLOOD_S seconds; one honest peer sends a normal group every 0.2 s. Two runs, same script:
- baseline: the generic wire limits (`WireLimits()`: prompts and completions up to 32,768 tokens,
  frames up to 16 MiB), which is what an inbox accepted before its limits came from the run;
- run limits: what `WireLimits.for_run` gives the learner for the embedded default (completions up to
  the run's 16 tokens, prompts up to the 240 the model's 256-token context leaves).
The inbox process stops itself past MEMORY_CAP_BYTES (and the run is reported as having passed it).

`python -m benchmarks flood_memory`
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.common import RESULTS, markdown_table, write_result

FLOOD_S = 20.0
IDLE_S = 3.0
CAPACITY = 64  # the learner's default queue: 2 x groups_per_step
MEMORY_CAP_BYTES = 3 * 1024**3
RUN_ID = "bench-flood"


def limits_for(mode: str):
    from swarm.fabric.rollouts.wire import WireLimits

    if mode == "baseline":
        return WireLimits()
    from swarm.config import GenerationSettings, default_of
    from swarm.model.loading import load_policy

    model, _ = load_policy("embedded")
    return WireLimits.for_run(model.config.max_position_embeddings, default_of(GenerationSettings, "max_completion_length"))


def serve(transport: str, bootstrap: str, limits: str, seconds: float, out: Path) -> None:
    """The inbox process: join, take groups at 20/s, sample resident memory every 0.25 s."""
    import psutil

    from swarm.fabric.rollouts.bans import PeerBans
    from swarm.fabric.transports import join
    from swarm.fabric.rollouts.wire import WireLimits

    me = psutil.Process()
    fabric = join(transport, run_id=RUN_ID, peers=[bootstrap], role="peer")
    inbox = fabric.rollout_inbox(vocab_size=99, capacity=CAPACITY, limits=WireLimits(**json.loads(limits)), put_timeout_s=5.0,
                                 bans=PeerBans(ban_s=0))
    (out.with_suffix(".ready")).write_text(fabric.peer_id)
    samples, taken, capped = [], {}, None
    started = time.time()
    next_take = next_sample = started
    while time.time() - started < seconds:
        now = time.time()
        if now >= next_sample:
            rss = me.memory_info().rss
            samples.append((round(now - started, 2), rss))
            next_sample += 0.25
            if rss > MEMORY_CAP_BYTES:
                capped = now - started
                break
        if now >= next_take:
            group = inbox.get(timeout=0)
            if group is not None:
                taken[group.sender] = taken.get(group.sender, 0) + 1
            next_take += 0.05
        time.sleep(0.005)
    out.write_text(json.dumps({"samples": samples, "taken": taken, "capped_at_s": capped,
                               "refused": dict(inbox.stats.reasons)}))
    inbox.close()
    fabric.shutdown()  # its DHT runs in a process of its own
    os._exit(0)  # then leave at once (a capped inbox holds gigabytes that need not be freed)


def fresh(frame: bytes) -> bytes:
    """The same group under a new uid (the inbox refuses a uid it has seen as a duplicate)."""
    import uuid

    return frame.replace(TEMPLATE_UID.encode(), uuid.uuid4().hex.encode(), 1)


TEMPLATE_UID = "f" * 32


def maximal_frame(limits, rng) -> bytes:
    """The largest group the limits let through (fitting in a frame), valid in every field."""
    from swarm.fabric.rollouts.wire import encode_group
    from swarm.rollouts import RolloutGroup

    g = limits.max_completions
    per_completion = min(limits.max_completion_tokens, (limits.max_frame_bytes - 4 * limits.max_prompt_tokens) // (8 * g) - 64)
    prompt = [rng.randrange(3, 99) for _ in range(limits.max_prompt_tokens)]
    tokens = [rng.randrange(3, 99) for _ in range(per_completion)]
    return encode_group(RolloutGroup("arith-d2-1+2", prompt, [tokens] * g, [[-0.5] * per_completion] * g, [0.0] * g,
                                     version=0, sampler_id="flood"), uid=TEMPLATE_UID)


def honest_frame() -> bytes:
    from swarm.fabric.rollouts.wire import encode_group
    from swarm.rollouts import RolloutGroup

    return encode_group(RolloutGroup("arith-d2-1+2", list(range(3, 40)), [list(range(3, 19))] * 8, [[-0.1] * 16] * 8,
                                     [1.0] * 8, version=0, sampler_id="honest"), uid=TEMPLATE_UID)


def flood(transport: str, mode: str) -> dict:
    import random

    from swarm.fabric.transports import join, start_bootstrap

    bootstrap = start_bootstrap(transport, run_id=RUN_ID, host="127.0.0.1", port=0)
    out = RESULTS / f".flood-{transport}-{mode}.json"
    out.unlink(missing_ok=True)
    out.with_suffix(".ready").unlink(missing_ok=True)
    limits = limits_for(mode)
    child = subprocess.Popen([sys.executable, "-m", "benchmarks.flood_memory", transport, bootstrap.addresses()[0],
                              json.dumps(dataclasses.asdict(limits)), str(IDLE_S + FLOOD_S + 2), str(out)])
    peers, threads, stop = [], [], threading.Event()
    sent = {"flood_ok": 0, "flood_refused": 0, "honest_ok": 0, "honest_refused": 0, "errors": 0}
    lock = threading.Lock()
    try:
        deadline = time.time() + 120
        while not out.with_suffix(".ready").exists():
            if time.time() > deadline or child.poll() is not None:
                raise RuntimeError("the inbox process did not start")
            time.sleep(0.2)
        learner = out.with_suffix(".ready").read_text()
        frame = maximal_frame(limits, random.Random(0))

        def send_loop(sender, frames, kind, pause):
            while not stop.is_set():
                try:
                    acks = sender.send_frames(learner, [fresh(f) for f in frames])
                except Exception:  # noqa: BLE001  a cut stream: count it and go on flooding
                    with lock:
                        sent["errors"] += 1
                    stop.wait(0.1)
                    continue
                with lock:
                    sent[f"{kind}_ok"] += sum(bool(a.get("ok")) for a in acks)
                    sent[f"{kind}_refused"] += sum(not a.get("ok") for a in acks)
                stop.wait(pause)

        for _ in range(3):
            fabric = join(transport, run_id=RUN_ID, peers=bootstrap.addresses(), role="peer")
            peers.append(fabric)
            for _ in range(4):
                threads.append(threading.Thread(target=send_loop, args=(fabric.rollout_sender(timeout_s=30), [frame] * 4, "flood", 0),
                                                daemon=True))
        honest = join(transport, run_id=RUN_ID, peers=bootstrap.addresses(), role="peer")
        honest_id = honest.peer_id
        peers.append(honest)
        threads.append(threading.Thread(target=send_loop, args=(honest.rollout_sender(timeout_s=30), [honest_frame()], "honest", 0.2),
                                        daemon=True))
        time.sleep(IDLE_S)
        for thread in threads:
            thread.start()
        child.wait(timeout=IDLE_S + FLOOD_S + 120)
    finally:
        stop.set()
        if child.poll() is None:
            child.kill()
        for fabric in peers:
            fabric.shutdown()
        bootstrap.shutdown()
    found = json.loads(out.read_text())
    out.unlink(missing_ok=True)
    out.with_suffix(".ready").unlink(missing_ok=True)
    rss = [r for _, r in found["samples"]]
    idle = [r for t, r in found["samples"] if t < IDLE_S] or rss[:1]
    flooded = [r for t, r in found["samples"] if t >= IDLE_S]
    half = len(flooded) // 2
    return {
        "transport": transport, "limits": mode, "frame_bytes": len(frame),
        "idle_rss_mb": round(max(idle) / 2**20, 1), "peak_rss_mb": round(max(rss) / 2**20, 1),
        "peak_over_idle": round(max(rss) / max(idle), 2),
        # flat: the second half of the flood holds no more than the first
        "late_over_early": round(max(flooded[half:] or [0]) / max(max(flooded[:half] or [1]), 1), 3) if flooded else None,
        "passed_cap_after_s": found["capped_at_s"],
        "taken_by_learner": sum(found["taken"].values()),
        "honest_taken": found["taken"].get(honest_id, 0),
        **sent,
        "refused_reasons": found["refused"],
    }


def run() -> dict:
    rows = [flood("hivemind", "baseline"), flood("hivemind", "run")]
    base, capped = rows
    figures = {"runs": rows, "flood_s": FLOOD_S, "capacity": CAPACITY,
               "peak_ratio_run_over_baseline": round(capped["peak_rss_mb"] / base["peak_rss_mb"], 3)}
    table = markdown_table(
        ["limits", "frame bytes", "idle RSS MB", "peak RSS MB", "peak / idle", "late / early flood", "passed 3 GiB after s",
         "groups taken", "honest taken", "honest ok / refused", "flood ok / refused"],
        [[r["limits"], r["frame_bytes"], r["idle_rss_mb"], r["peak_rss_mb"], r["peak_over_idle"], r["late_over_early"],
          r["passed_cap_after_s"] or "no", r["taken_by_learner"], r["honest_taken"], f"{r['honest_ok']} / {r['honest_refused']}",
          f"{r['flood_ok']} / {r['flood_refused']}"] for r in rows])
    markdown = (f"# Learner inbox memory under a flood of maximal groups\n\n{__doc__.strip()}\n\n{table}\n"
                f"Peak memory with the run's limits is {figures['peak_ratio_run_over_baseline']:.3g}x the baseline's "
                f"(the baseline run stops itself past 3 GiB). Over hivemind, {FLOOD_S:.0f} s of flood, queue capacity {CAPACITY}.\n")
    write_result("flood_memory", figures, markdown)
    return figures


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), Path(sys.argv[5]))
