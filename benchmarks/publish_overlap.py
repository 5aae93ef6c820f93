"""Learner steps per second with publishing off, inline (the old way: every version encoded and
hashed in the training loop, held whole) and in the background (swarm.fabric.weights.publisher:
the training thread only copies the weights to the CPU in the publish dtype; the publisher encodes
the delta and the undo delta, hashes and holds the version at a lower priority, skipping versions
when it falls behind). Target: background >= 0.95 x off.

The mid-size model (swarm/model/midsize.py, ~50 M parameters, float32 master weights, published in
bfloat16) steps on a fixed batch of random tokens (forward, backward, AdamW at lr 1e-6), in one
process. The three modes alternate in blocks of steps so that drift of a shared machine affects
each alike; the median step time of each is reported.

`python -m benchmarks publish_overlap` (GEPO_PUBLISH_OVERLAP_BLOCKS=3, GEPO_PUBLISH_OVERLAP_STEPS=4: blocks per mode, steps a block)
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from benchmarks.common import markdown_table, write_result


def run() -> dict:
    from benchmarks.learner_overhead import make_batch
    from swarm.fabric.weights.publisher import Publisher
    from swarm.fabric.weights.versions import VersionStore
    from swarm.logprobs import completion_logprobs
    from swarm.model.loading import load_policy
    from swarm.model.midsize import midsize_model_dir

    blocks = int(os.environ.get("GEPO_PUBLISH_OVERLAP_BLOCKS", 3))
    per_block = int(os.environ.get("GEPO_PUBLISH_OVERLAP_STEPS", 4))
    load_before = os.getloadavg()[0]
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

    def snapshot() -> dict[str, torch.Tensor]:  # what Learner.publish hands over
        return {k: v.detach().to("cpu", torch.bfloat16 if v.is_floating_point() else v.dtype, copy=True)
                for k, v in model.state_dict().items()}

    inline_store = VersionStore(capacity=65)  # the old store: every version whole, encoded in the loop
    background_store = VersionStore(capacity=65, whole_states=1, cached_states=1, delta_budget=0.5)  # the learner's now
    publisher = Publisher(background_store, on_published=lambda v, d: None)
    version = 0
    inline_store.add(version, snapshot(), owned=True)
    publisher.publish_now(version, snapshot())
    train_step()  # warm-up
    times: dict[str, list[float]] = {"off": [], "inline": [], "background": []}
    try:
        for _ in range(blocks):
            for mode in times:
                for _ in range(per_block):
                    started = time.perf_counter()
                    train_step()
                    version += 1
                    if mode == "inline":
                        inline_store.add(version, snapshot(), owned=True)
                    elif mode == "background":
                        publisher.submit(version, snapshot())
                    times[mode].append(time.perf_counter() - started)
                if mode == "background":  # its tail is not the next mode's cost
                    publisher.wait()
    finally:
        publisher.close()
    load_after = os.getloadavg()[0]
    median = {mode: statistics.median(t) for mode, t in times.items()}
    figures = {
        "parameters": params, "blocks": blocks, "steps_per_block": per_block,
        "median_step_seconds": {m: round(s, 3) for m, s in median.items()},
        "steps_per_second_over_off": {m: round(median["off"] / s, 3) for m, s in median.items()},
        "background_published": publisher.published - 1, "background_skipped": len(publisher.skipped),
        "background_publisher_busy_seconds": round(publisher.busy_seconds, 1),
        "load_average": [round(load_before, 2), round(load_after, 2)], "cpus": os.cpu_count(),
        "busy": load_before > 1.5 or load_after > 1.5,
    }
    ratio = figures["steps_per_second_over_off"]
    markdown = (f"# Publishing off the training loop\n\n{__doc__.strip()}\n\n"
                + markdown_table(["publishing", "median step (s)", "steps/s over off"],
                                 [[m, figures["median_step_seconds"][m], ratio[m]] for m in times])
                + f"\nBackground: {figures['background_published']} versions published, {figures['background_skipped']} "
                  f"skipped (their change carried by the next delta), {figures['background_publisher_busy_seconds']} s "
                  f"publishing. Load average before/after: {figures['load_average']} on {os.cpu_count()} CPUs"
                + (" (the machine was busy with other work: the ratios are disturbed)" if figures["busy"] else "") + "\n")
    write_result("publish_overlap", figures, markdown)
    return figures
