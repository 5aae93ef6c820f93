"""Learner steps per second with publishing off, and on with the publisher's encoding in a thread
and in a process of its own (swarm.fabric.weights.publisher, isolation "thread" and "process"). Target:
publishing on >= 0.95 x off.

Two cases, each in this one process, its modes alternating in blocks of steps so that drift of a
shared machine affects each alike; the median step time of each mode is reported.

- **launch_bound**: what a GPU learner's training thread is like, without a GPU: a Python loop of
  many small torch ops (GEPO_PUBLISH_OVERLAP_OPS, 3,000, on 64-element tensors, one torch thread),
  like the thousands of kernel launches of a GPU step, each needing the GIL; every step submits a
  version of a large bf16 state (GEPO_PUBLISH_OVERLAP_ELEMENTS, 150 M elements in 8 tensors, ~4% of
  its elements moved a version). A publisher thread's Python-level codec work holds the GIL the loop
  needs (CPython hands it over only every sys.getswitchinterval(), 5 ms); an encoding process shares
  no GIL with it. The training thread is pinned to one CPU and the publishers (their threads, the
  codec's workers, the encoding process) to the others (GEPO_PUBLISH_OVERLAP_PIN=0: not), as on a
  GPU learner whose publisher has idle cores: what is left is the GIL (and memory bandwidth).
- **midsize**: the mid-size model (swarm/model/midsize.py, ~50 M parameters, float32 master
  weights, published in bfloat16) steps on a fixed batch of random tokens (forward, backward, AdamW
  at lr 1e-6), with also "inline" (the old way: every version encoded in the training loop).
  CPU-bound: the publisher competes for cores rather than for the GIL. Its process runs at idle
  priority, as a CPU learner's does (it takes only what training leaves, and skips versions
  rather than slow the steps: count the versions published beside the ratio).

`python -m benchmarks publish_overlap` (GEPO_PUBLISH_OVERLAP_CASES=launch_bound,midsize;
GEPO_PUBLISH_OVERLAP_BLOCKS=3, GEPO_PUBLISH_OVERLAP_STEPS=4 midsize / 100 launch_bound: blocks per mode, steps a block)
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from benchmarks.common import markdown_table, write_result

CASES = ("launch_bound", "midsize")


def _publishers(make_store, first: dict[str, torch.Tensor], idle: bool = False) -> dict:
    """A thread and a process publisher (`idle`: at idle priority), each with its store, each with version 0 published."""
    from swarm.fabric.weights.publisher import Publisher

    publishers = {}
    for isolation in ("thread", "process"):
        publishers[isolation] = Publisher(make_store(), on_published=lambda v, d: None, isolation=isolation, idle=idle)
        publishers[isolation].publish_now(0, dict(first))
        publishers[isolation].busy_seconds = 0.0  # (the first waited for the encoding process to start)
    return publishers


def _blocks(modes: list[str], blocks: int, per_block: int, step, publish) -> dict[str, list[float]]:
    """Step times per mode, the modes alternating in blocks; `publish(mode, version)` after each step."""
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    version = 0
    for _ in range(blocks):
        for mode in modes:
            for _ in range(per_block):
                started = time.perf_counter()
                step()
                version += 1
                publish(mode, version)
                times[mode].append(time.perf_counter() - started)
            publish(mode, None)  # the publisher's tail (waited for) is not the next mode's cost
    return times


def _summary(times: dict[str, list[float]], publishers: dict) -> dict:
    median = {mode: statistics.median(t) for mode, t in times.items()}
    return {"median_step_seconds": {m: round(s, 4) for m, s in median.items()},
            "steps_per_second_over_off": {m: round(median["off"] / s, 3) for m, s in median.items()},
            "published": {m: p.published - 1 for m, p in publishers.items()},
            "skipped": {m: len(p.skipped) for m, p in publishers.items()},
            "publisher_busy_seconds": {m: round(p.busy_seconds, 1) for m, p in publishers.items()},
            "shared_blocks_reused": publishers["process"].blocks_reused}


def launch_bound(blocks: int, per_block: int) -> dict:
    from swarm.fabric.weights.versions import VersionStore

    ops = int(os.environ.get("GEPO_PUBLISH_OVERLAP_OPS", 3000))
    elements = int(float(os.environ.get("GEPO_PUBLISH_OVERLAP_ELEMENTS", 150e6)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    per_tensor = elements // 8
    base = {f"layer.{i}.weight": (torch.randn(per_tensor, generator=gen) * 0.02).to(torch.bfloat16) for i in range(8)}
    states = [base]
    for _ in range(2):  # versions cycle through three states, each ~4% of elements one bf16 step from the last
        nxt = {}
        for name, t in states[-1].items():
            bits = t.view(torch.int16).clone()
            moved = torch.rand(t.shape, generator=gen) < 0.04
            bits[moved] += 1
            nxt[name] = bits.view(torch.bfloat16)
        states.append(nxt)
    x = torch.ones(64)

    def step() -> None:  # ~`ops` small ops, each a trip through the dispatcher with the GIL held (a kernel launch)
        y = x
        for _ in range(ops // 2):
            y = y * 1.0001
            y = y + 0.0001

    publishers = _publishers(lambda: VersionStore(capacity=65, whole_states=1, cached_states=1, delta_budget=0.5), base)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
    pinned = os.environ.get("GEPO_PUBLISH_OVERLAP_PIN", "1") == "1" and len(cpus) >= 2
    if pinned:  # the training thread on one CPU, the publishers (threads they start inherit it) on the others
        os.sched_setaffinity(publishers["thread"]._thread.native_id, cpus[1:])
        os.sched_setaffinity(publishers["process"].encoder_pid, cpus[1:])
        os.sched_setaffinity(0, cpus[:1])  # (Linux: this thread only)

    def publish(mode: str, version: int | None) -> None:
        if mode == "off":
            return
        if version is None:
            publishers[mode].wait()
        else:
            publishers[mode].submit(version, dict(states[version % 3]))

    try:
        step()  # warm-up
        times = _blocks(["off", "thread", "process"], blocks, per_block, step, publish)
    finally:
        for publisher in publishers.values():
            publisher.close()
        torch.set_num_threads(threads)
        if pinned:
            os.sched_setaffinity(0, cpus)
    return {"ops_per_step": ops, "state_elements": per_tensor * 8, "blocks": blocks, "steps_per_block": per_block,
            "training_pinned_to_cpu": cpus[0] if pinned else None, **_summary(times, publishers)}


def midsize(blocks: int, per_block: int) -> dict:
    from benchmarks.learner_overhead import make_batch
    from swarm.fabric.weights.versions import VersionStore
    from swarm.logprobs import completion_logprobs
    from swarm.lora import policy_state
    from swarm.model.loading import load_policy
    from swarm.model.midsize import midsize_model_dir

    model, _ = load_policy(str(midsize_model_dir()))
    model.train()
    params = sum(p.numel() for p in model.parameters())
    p_ids, p_mask, c_ids, c_mask, *_ = make_batch(model.config.vocab_size, prompts=4, group=4, prompt_len=32, completion_len=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def train_step() -> None:
        logprobs = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask)
        loss = -(logprobs * c_mask).sum() / c_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def snapshot() -> dict[str, torch.Tensor]:  # what the old store was handed
        return policy_state(model, torch.bfloat16, copy=True)

    inline_store = VersionStore(capacity=65)  # the old store: every version whole, encoded in the loop
    inline_store.add(0, snapshot(), owned=True)
    # the process at idle priority, as a CPU learner runs it (peers/learner_setup.publish_isolation)
    publishers = _publishers(lambda: VersionStore(capacity=65, whole_states=1, cached_states=1, delta_budget=0.5), snapshot(),
                             idle=True)

    def publish(mode: str, version: int | None) -> None:
        if mode == "off" or (version is None and mode == "inline"):
            return
        if mode == "inline":
            inline_store.add(version, snapshot(), owned=True)
        elif version is None:
            publishers[mode].wait()
        else:  # as Learner.publish does
            publishers[mode].submit(version, publishers[mode].copy_state(policy_state(model), torch.bfloat16))

    try:
        train_step()  # warm-up
        times = _blocks(["off", "inline", "thread", "process"], blocks, per_block, train_step, publish)
    finally:
        for publisher in publishers.values():
            publisher.close()
    return {"parameters": params, "blocks": blocks, "steps_per_block": per_block, **_summary(times, publishers)}


def run() -> dict:
    cases = [c for c in os.environ.get("GEPO_PUBLISH_OVERLAP_CASES", ",".join(CASES)).split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)} in GEPO_PUBLISH_OVERLAP_CASES (known: {', '.join(CASES)})")
    blocks = int(os.environ.get("GEPO_PUBLISH_OVERLAP_BLOCKS", 3))
    steps = os.environ.get("GEPO_PUBLISH_OVERLAP_STEPS")
    load_before = os.getloadavg()[0]
    figures: dict = {}
    for case in cases:
        per_block = int(steps) if steps else {"launch_bound": 100, "midsize": 4}[case]
        figures[case] = (launch_bound if case == "launch_bound" else midsize)(blocks, per_block)
    load_after = os.getloadavg()[0]
    figures.update({"load_average": [round(load_before, 2), round(load_after, 2)], "cpus": os.cpu_count(),
                    # before only: the load after is this benchmark's own (training on every core, the publisher beside it)
                    "busy": load_before > 0.75 * (os.cpu_count() or 1)})
    markdown = f"# Publishing off the training loop\n\n{__doc__.strip()}\n"
    for case in cases:
        f = figures[case]
        markdown += (f"\n## {case}\n\n"
                     + markdown_table(["publishing", "median step (s)", "steps/s over off"],
                                      [[m, f["median_step_seconds"][m], f["steps_per_second_over_off"][m]]
                                       for m in f["median_step_seconds"]])
                     + "\n" + "; ".join(f"{m}: {f['published'][m]} versions published, {f['skipped'][m]} skipped, "
                                        f"{f['publisher_busy_seconds'][m]} s publishing" for m in f["published"]) + "\n")
    markdown += (f"\nLoad average before/after: {figures['load_average']} on {os.cpu_count()} CPUs"
                 + (" (the machine was busy with other work: the ratios are disturbed)" if figures["busy"] else "") + "\n")
    write_result("publish_overlap", figures, markdown)
    return figures
