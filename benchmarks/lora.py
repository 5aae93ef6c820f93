"""LoRA against full fine-tuning on the mid-size model (swarm/model/midsize.py: Qwen3 architecture,
tens of millions of parameters): what a version weighs, what a learner step needs, and what a
sampler's version swap costs (issue 46).

- Version bytes: the bfloat16 snapshot a learner publishes (swarm.fabric.weights.delta.encode_snapshot)
  of the adapter (r=16 on every attention and MLP projection) against the whole model's, and one
  step's delta of each.
- Learner step: one LearnerCore step on synthetic groups (random tokens: memory and time depend on
  shapes), AdamW's state made in the step (its first), in float32. Memory is what training holds
  on top of the loaded model: the peak during the step minus the memory just before it (gradients,
  AdamW's two moments, activations). On a CPU it is the process's resident memory sampled every
  5 ms, each mode in a fresh process (an allocator keeps what an earlier mode freed); on CUDA
  torch.cuda.max_memory_allocated. Time: a second, warm step.
- Sampler swap: the seconds to put a new version into a transformers backend that holds the base
  already: the adapter copied in (unmerged), or unmerged, copied and merged again (merged), against
  a whole version loaded into a full fine-tuning sampler. And generation time, merged against
  unmerged, which decides the default of --lora-merged.

`measure(device)` runs every comparison in the calling process and returns the figures (for a GPU
check); `python -m benchmarks lora` runs it on this CPU (memory in fresh processes) and writes
benchmarks/results/lora.{json,md}.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

from benchmarks.common import markdown_table, write_result

R, ALPHA = 16, 32.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GROUPS = 4  # per learner step (synthetic: G=4 completions of 64 tokens after 32-token prompts)
SWAPS = 3  # version swaps timed, the median kept
GOALS = {"snapshot_ratio": 0.02, "step_memory_ratio": 0.5}


def _model(lora: bool, device: str = "cpu", model_dir: str | None = None):
    import torch

    from swarm.lora import wrap_lora
    from swarm.model.loading import load_policy
    from swarm.model.midsize import midsize_model_dir

    torch.manual_seed(0)
    model, tokenizer = load_policy(model_dir or str(midsize_model_dir()), device=device)
    return (wrap_lora(model, r=R, alpha=ALPHA, target_modules=TARGETS) if lora else model), tokenizer


def _core(model, tokenizer):
    from swarm.config import LearnerConfig
    from swarm.training import LearnerCore

    return LearnerCore(model, tokenizer.pad_token_id, micro_batch_groups=GROUPS, learning_rate=1e-3, lr_warmup_steps=0,
                       max_grad_norm=LearnerConfig.model_fields["max_grad_norm"].default)


def version_bytes(model, core, tokenizer) -> dict:
    """Snapshot and one step's delta of `model`'s published state, in bfloat16."""
    import torch

    from benchmarks.learner_memory import groups
    from swarm.fabric.weights.delta import encode_delta, encode_snapshot
    from swarm.lora import policy_state

    before = policy_state(model, torch.bfloat16, copy=True)
    core.step(groups(GROUPS, len(tokenizer), seed=3))
    after = policy_state(model, torch.bfloat16, copy=True)
    return {"tensors": len(after), "elements": sum(t.numel() for t in after.values()),
            "snapshot_bytes": len(encode_snapshot(after, 1)),
            "delta_bytes": len(encode_delta(before, after, base_version=0, version=1))}


def step_figures(lora: bool, device: str = "cpu", model_dir: str | None = None) -> dict:
    """One mode's learner step: memory on top of the loaded model (the first step, AdamW's state
    made in it) and the seconds of a second, warm step; then its version bytes."""
    import psutil
    import torch

    from benchmarks.learner_memory import groups

    model, tokenizer = _model(lora, device, model_dir)
    core = _core(model, tokenizer)
    batch = groups(GROUPS, len(tokenizer))
    me, peak, stop = psutil.Process(), [0], threading.Event()
    cuda = device.startswith("cuda")

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], me.memory_info().rss)
            time.sleep(0.005)

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = peak[0] = me.memory_info().rss
        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
    core.step(batch)
    if cuda:
        torch.cuda.synchronize()
        memory = torch.cuda.max_memory_allocated() - before
    else:
        stop.set()
        watcher.join()
        memory = peak[0] - before
    started = time.perf_counter()
    core.step(batch)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"lora": lora, "device": device, "trainable_parameters": trainable,
            "parameters": sum(p.numel() for p in model.parameters()), "step_memory_mb": round(memory / 2**20, 1),
            "step_seconds": round(seconds, 3), "version": version_bytes(model, core, tokenizer)}


def swap_figures(device: str = "cpu", model_dir: str | None = None) -> dict:
    """Seconds to put a new version into a sampler that holds the base: adapter (unmerged, merged)
    against a whole version; and generation seconds merged against unmerged."""
    import copy

    import torch

    from swarm.fabric.weights.delta import state_hash
    from swarm.generation import SamplingParams
    from swarm.generation.transformers_backend import TransformersBackend
    from swarm.lora import adapter_spec, base_state, policy_state

    learner, tokenizer = _model(True, device, model_dir)
    with torch.no_grad():
        for name, p in learner.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.01)  # a trained adapter's B is not zero
    spec = adapter_spec(learner, state_hash(base_state(learner)))
    adapter = policy_state(learner, copy=True)
    full_model, _ = _model(False, device, model_dir)
    whole = policy_state(full_model, copy=True)
    figures = {}
    prompts = ["What is 17 + 25? Put the final answer in \\boxed{}."] * 4
    params = SamplingParams(num_completions=4, temperature=1.0, max_new_tokens=16, seed=0)
    for name, merged in (("unmerged", False), ("merged", True)):
        backend = TransformersBackend(copy.deepcopy(full_model), tokenizer)
        backend.use_adapter(spec, merged=merged)
        figures[f"swap_{name}_s"] = _median_seconds(lambda: backend.load_state_dict(adapter), device)
        backend.generate(prompts, params)  # warm
        figures[f"generate_{name}_s"] = _median_seconds(lambda: backend.generate(prompts, params), device, times=3)
    plain = TransformersBackend(full_model, tokenizer)
    figures["swap_full_s"] = _median_seconds(lambda: plain.load_state_dict(whole), device)
    figures["adapter_bytes_in_memory"] = sum(t.numel() * t.element_size() for t in adapter.values())
    figures["full_bytes_in_memory"] = sum(t.numel() * t.element_size() for t in whole.values())
    return figures


def _median_seconds(action, device: str, times: int = SWAPS) -> float:
    import statistics

    import torch

    seconds = []
    for _ in range(times):
        started = time.perf_counter()
        action()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return round(statistics.median(seconds), 5)


def ratios(lora: dict, full: dict, swaps: dict) -> dict:
    return {
        "snapshot_ratio": round(lora["version"]["snapshot_bytes"] / full["version"]["snapshot_bytes"], 5),
        "delta_ratio": round(lora["version"]["delta_bytes"] / full["version"]["delta_bytes"], 5),
        "step_memory_ratio": round(lora["step_memory_mb"] / max(full["step_memory_mb"], 1e-9), 3),
        "step_time_ratio": round(lora["step_seconds"] / full["step_seconds"], 3),
        "swap_unmerged_over_full": round(swaps["swap_unmerged_s"] / swaps["swap_full_s"], 4),
        "swap_merged_over_full": round(swaps["swap_merged_s"] / swaps["swap_full_s"], 4),
        "generate_merged_over_unmerged": round(swaps["generate_merged_s"] / swaps["generate_unmerged_s"], 3),
    }


def measure(device: str = "cpu", model_dir: str | None = None) -> dict:
    """Every comparison in this process, on `model_dir` (default: the mid-size model). On CUDA the
    memory figures are exact per step (LoRA measured first: the caching allocator would hand it what
    full fine-tuning freed, which max_memory_allocated does not count anyway); on a CPU resident
    memory carries over between modes, so `run` measures each mode in a fresh process instead."""
    lora = step_figures(True, device, model_dir)
    full = step_figures(False, device, model_dir)
    swaps = swap_figures(device, model_dir)
    found = ratios(lora, full, swaps)
    return {"lora": lora, "full": full, "swaps": swaps, "ratios": found,
            "goals_met": {k: found[k] <= v for k, v in GOALS.items()}}


def in_fresh_process(lora: bool) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.lora", json.dumps({"lora": lora})], capture_output=True,
                         text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"benchmarks.lora (lora={lora}) failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def busy() -> dict:
    import os

    import psutil

    load = os.getloadavg()
    return {"load_average_1m": round(load[0], 2), "cpu_count": os.cpu_count(), "busy": load[0] > 0.5 * (os.cpu_count() or 1),
            "available_memory_gb": round(psutil.virtual_memory().available / 2**30, 1)}


def run() -> dict:
    from swarm.model.midsize import midsize_model_dir

    midsize_model_dir()  # built once, before the measured processes
    from concurrent.futures import ThreadPoolExecutor

    machine_before = busy()
    # the two modes' processes run side by side (each one's resident memory is its own; both
    # step times are slowed alike), and the swaps meanwhile in this one
    with ThreadPoolExecutor(2) as pool:
        modes = [pool.submit(in_fresh_process, lora) for lora in (False, True)]
        swaps = swap_figures("cpu")
        full, lora = (mode.result() for mode in modes)
    found = ratios(lora, full, swaps)
    figures = {"lora": lora, "full": full, "swaps": swaps, "ratios": found, "goals": GOALS,
               "goals_met": {k: found[k] <= v for k, v in GOALS.items()}, "machine_load": [machine_before, busy()]}
    write_result("lora", figures, markdown(figures))
    return figures


def markdown(figures: dict) -> str:
    lora, full, swaps, found = figures["lora"], figures["full"], figures["swaps"], figures["ratios"]
    rows = [[mode, m["trainable_parameters"], m["version"]["snapshot_bytes"], m["version"]["delta_bytes"],
             m["step_memory_mb"], m["step_seconds"]] for mode, m in (("full fine-tuning", full), (f"LoRA r={R}", lora))]
    table = markdown_table(["mode", "trainable parameters", "snapshot bytes (bf16)", "delta bytes", "step memory MB",
                            "step seconds"], rows)
    load = figures.get("machine_load", [{}])[0]
    busy_note = (f"The machine was busy (1-minute load {load.get('load_average_1m')} on {load.get('cpu_count')} cores, "
                 "other sessions running): absolute times are disturbed, the ratios less so; re-run on a quiet machine "
                 "for absolute figures.") if load.get("busy") else "The machine was quiet."
    return (f"# LoRA against full fine-tuning\n\n{__doc__.strip()}\n\nModel: {full['parameters']:,} parameters; adapter "
            f"r={R}, alpha={ALPHA:g} on {', '.join(TARGETS)}. {busy_note}\n\n{table}\n"
            f"- Snapshot: LoRA {found['snapshot_ratio']:.2%} of full (goal <= {GOALS['snapshot_ratio']:.0%}); one step's "
            f"delta {found['delta_ratio']:.2%} of full's (every adapter element moves each step).\n"
            f"- Step memory on top of the loaded model: {found['step_memory_ratio']:.2f}x of full (goal <= "
            f"{GOALS['step_memory_ratio']}x); step time {found['step_time_ratio']:.2f}x.\n"
            f"- Sampler swap: adapter unmerged {swaps['swap_unmerged_s'] * 1e3:.2f} ms, merged "
            f"{swaps['swap_merged_s'] * 1e3:.2f} ms, a whole version {swaps['swap_full_s'] * 1e3:.2f} ms "
            f"({found['swap_unmerged_over_full']:.3f}x and {found['swap_merged_over_full']:.3f}x of it).\n"
            f"- Generation merged over unmerged: {found['generate_merged_over_unmerged']:.2f}x the time.\n")


if __name__ == "__main__":
    import torch

    torch.set_num_threads(2)
    print(json.dumps(step_figures(**json.loads(sys.argv[1]))))
