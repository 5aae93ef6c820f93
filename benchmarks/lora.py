"""LoRA against full fine-tuning on the mid-size model (swarm/model/midsize.py: Qwen3 architecture,
tens of millions of parameters): what a version weighs, what a learner step needs, and what a
sampler's version swap costs (issue 46).

- Version bytes: the bfloat16 snapshot a learner publishes (swarm.fabric.weights.delta.encode_snapshot)
  of the adapter (r=16 on every attention and MLP projection) against the whole model's, and one
  step's delta of each.
- Version bytes by target modules and shape: the bf16 snapshot of an r=16 adapter on every
  projection, on the attention projections and on PEFT's default for Qwen models (q_proj, v_proj),
  against the whole model's, on the mid-size model and at Qwen3-0.6B's shape (random weights: a
  snapshot's bytes depend on shapes only; no training step).
- Learner step: two LearnerCore steps on synthetic groups (random tokens: memory and time depend on
  shapes), in float32, without and with gradient checkpointing. Memory is what training holds on
  top of the loaded model: the peak over both steps (the second holds AdamW's two moments, made in
  the first, while it makes activations and gradients) minus the memory before the first. On a CPU
  it is the process's peak resident memory (VmHWM), each mode in a fresh process whose glibc
  returns every allocation of 64 KiB or more on free (MALLOC_MMAP_THRESHOLD_): with glibc's
  default, sliding threshold freed activations stay resident, by chance more in one mode than in
  another (the first version of this benchmark measured LoRA at 1.33x of full fine-tuning that
  way); on CUDA torch.cuda.max_memory_allocated. Time: the second, warm step.
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
import time

from benchmarks.common import markdown_table, write_result

R, ALPHA = 16, 32.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GROUPS = 4  # per learner step (synthetic: G=4 completions of 64 tokens after 32-token prompts)
SWAPS = 3  # version swaps timed, the median kept
GOALS = {"snapshot_ratio": 0.02, "step_memory_ratio": 0.5}
TARGET_SETS = {"every projection": TARGETS, "attention": TARGETS[:4], "PEFT's default (q, v)": ["q_proj", "v_proj"]}
# glibc: allocations of this size or more are mmapped and unmapped on free, so that resident memory
# follows live tensors (its default threshold slides up to 32 MiB as large blocks are freed, and
# freed activations then stay resident)
MMAP_THRESHOLD = 65536


def _model(lora: bool, device: str = "cpu", model_dir: str | None = None, targets: list[str] = TARGETS):
    import torch

    from swarm.lora import wrap_lora
    from swarm.model.loading import load_policy
    from swarm.model.midsize import midsize_model_dir

    torch.manual_seed(0)
    model, tokenizer = load_policy(model_dir or str(midsize_model_dir()), device=device)
    return (wrap_lora(model, r=R, alpha=ALPHA, target_modules=targets) if lora else model), tokenizer


def _core(model, tokenizer, checkpointing: bool = False):
    from swarm.config import LearnerConfig
    from swarm.training import LearnerCore

    return LearnerCore(model, tokenizer.pad_token_id, micro_batch_groups=GROUPS, learning_rate=1e-3, lr_warmup_steps=0,
                       max_grad_norm=LearnerConfig.model_fields["max_grad_norm"].default, gradient_checkpointing=checkpointing)


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


def _peak_resident() -> int:
    """The process's peak resident bytes since the last `_reset_peak` (Linux's VmHWM)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as refs:  # "5": reset the peak resident set size to the current one
        refs.write("5")


def step_figures(lora: bool, device: str = "cpu", model_dir: str | None = None, checkpointing: bool = False) -> dict:
    """One mode's learner step: memory on top of the loaded model over two steps (AdamW's state
    made in the first, held through the second) and the seconds of the second, warm one; then its
    version bytes."""
    import psutil
    import torch

    from benchmarks.learner_memory import groups

    model, tokenizer = _model(lora, device, model_dir)
    core = _core(model, tokenizer, checkpointing)
    batch = groups(GROUPS, len(tokenizer))
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = psutil.Process().memory_info().rss
        _reset_peak()
    core.step(batch)
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    core.step(batch)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    memory = (torch.cuda.max_memory_allocated() if cuda else _peak_resident()) - before
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"lora": lora, "gradient_checkpointing": checkpointing, "device": device, "trainable_parameters": trainable,
            "parameters": sum(p.numel() for p in model.parameters()), "step_memory_mb": round(memory / 2**20, 1),
            "step_seconds": round(seconds, 3), "version": version_bytes(model, core, tokenizer)}


def model_config(shape: str):
    """The transformers config of `shape`: "midsize" (swarm/model/midsize.py) or "qwen3_0_6b" (Qwen3-0.6B's)."""
    from transformers import AutoConfig, Qwen3Config

    from benchmarks.gpu_setup import QWEN3_0_6B
    from swarm.model.midsize import midsize_model_dir

    return AutoConfig.from_pretrained(str(midsize_model_dir())) if shape == "midsize" else Qwen3Config(**QWEN3_0_6B)


def adapter_version_bytes(shape: str, targets_sets: dict[str, list[str]] = TARGET_SETS, r: int = R) -> dict:
    """The bf16 snapshot bytes of an r-rank adapter on each target set, and of the whole model, at
    `shape`: random weights (a snapshot is the raw bits of its tensors: its size depends on shapes only)."""
    import torch
    from transformers import AutoModelForCausalLM

    from swarm.fabric.weights.delta import encode_snapshot
    from swarm.lora import policy_state, wrap_lora

    config = model_config(shape)
    with torch.device("meta"):  # shapes only: the base is never materialised here
        base = AutoModelForCausalLM.from_config(config)
    # named_parameters lists a tied parameter once (as a published state does: swarm.tied_weights, which
    # finds ties by storage, and meta tensors have none); Qwen3 has no persistent buffers
    whole = {name: torch.empty(p.shape, dtype=torch.bfloat16) for name, p in base.named_parameters()}
    full_elements = sum(t.numel() for t in whole.values())
    full_bytes = len(encode_snapshot(whole, 1))
    del whole
    out = {"shape": shape, "parameters": full_elements, "snapshot_bytes": full_bytes, "r": r, "adapters": {}}
    for label, targets in targets_sets.items():
        with torch.device("meta"):
            wrapped = wrap_lora(AutoModelForCausalLM.from_config(config), r=r, alpha=2.0 * r, target_modules=targets)
        adapter = {name: torch.randn(t.shape).to(torch.bfloat16) for name, t in policy_state(wrapped).items()}
        elements = sum(t.numel() for t in adapter.values())
        encoded = len(encode_snapshot(adapter, 1))
        out["adapters"][label] = {"targets": list(targets), "tensors": len(adapter), "elements": elements,
                                  "snapshot_bytes": encoded, "snapshot_ratio": round(encoded / full_bytes, 5),
                                  "arithmetic_ratio": round(arithmetic_adapter_elements(config, targets, r) / full_elements, 5)}
    return out


def arithmetic_adapter_elements(config, targets: list[str], r: int) -> int:
    """r x (in + out) per targeted linear layer, from the config alone (Hu et al. 2021: A is r x in, B out x r)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    h, q, kv, m = config.hidden_size, config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim, \
        config.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, m),
              "up_proj": (h, m), "down_proj": (m, h)}
    return config.num_hidden_layers * sum(r * sum(shapes[name]) for name in targets)


def largest_rank_within(config, targets: list[str], ratio: float, parameters: int) -> int:
    """The largest r whose adapter on `targets` is at most `ratio` of `parameters` (elements; bytes add a few KB)."""
    per_rank = arithmetic_adapter_elements(config, targets, 1)
    return int(ratio * parameters // per_rank)


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


MODES = {"full": (False, False), "lora": (True, False), "full_checkpointing": (False, True), "lora_checkpointing": (True, True)}


def ratios(modes: dict, swaps: dict) -> dict:
    lora, full = modes["lora"], modes["full"]
    return {
        "snapshot_ratio": round(lora["version"]["snapshot_bytes"] / full["version"]["snapshot_bytes"], 5),
        "delta_ratio": round(lora["version"]["delta_bytes"] / full["version"]["delta_bytes"], 5),
        "step_memory_ratio": round(lora["step_memory_mb"] / max(full["step_memory_mb"], 1e-9), 3),
        "step_memory_ratio_checkpointing": round(modes["lora_checkpointing"]["step_memory_mb"]
                                                 / max(modes["full_checkpointing"]["step_memory_mb"], 1e-9), 3),
        "step_time_ratio": round(lora["step_seconds"] / full["step_seconds"], 3),
        "swap_unmerged_over_full": round(swaps["swap_unmerged_s"] / swaps["swap_full_s"], 4),
        "swap_merged_over_full": round(swaps["swap_merged_s"] / swaps["swap_full_s"], 4),
        "generate_merged_over_unmerged": round(swaps["generate_merged_s"] / swaps["generate_unmerged_s"], 3),
    }


def goals_met(found: dict) -> dict:
    return {"snapshot_ratio": found["snapshot_ratio"] <= GOALS["snapshot_ratio"],
            "step_memory_ratio": found["step_memory_ratio"] <= GOALS["step_memory_ratio"],
            "step_memory_ratio_checkpointing": found["step_memory_ratio_checkpointing"] <= GOALS["step_memory_ratio"]}


def measure(device: str = "cpu", model_dir: str | None = None) -> dict:
    """Every comparison in this process, on `model_dir` (default: the mid-size model). On CUDA the
    memory figures are exact per mode (max_memory_allocated counts live tensors, not what the caching
    allocator keeps from an earlier mode); on a CPU resident memory carries over between modes, so
    `run` measures each mode in a fresh process instead."""
    import gc

    modes = {}
    for name, (lora, checkpointing) in MODES.items():
        modes[name] = step_figures(lora, device, model_dir, checkpointing)
        gc.collect()
    swaps = swap_figures(device, model_dir)
    found = ratios(modes, swaps)
    return {"modes": modes, "swaps": swaps, "ratios": found, "goals_met": goals_met(found)}


def in_fresh_process(mode: str) -> dict:
    import os

    lora, checkpointing = MODES[mode]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    out = subprocess.run([sys.executable, "-m", "benchmarks.lora", json.dumps({"lora": lora, "checkpointing": checkpointing})],
                         capture_output=True, text=True, timeout=1800, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"benchmarks.lora ({mode}) failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def busy() -> dict:
    import os

    import psutil

    load = os.getloadavg()
    return {"load_average_1m": round(load[0], 2), "cpu_count": os.cpu_count(), "busy": load[0] > 0.5 * (os.cpu_count() or 1),
            "available_memory_gb": round(psutil.virtual_memory().available / 2**30, 1)}


def run() -> dict:
    import gc
    from concurrent.futures import ThreadPoolExecutor

    from swarm.model.midsize import midsize_model_dir

    midsize_model_dir()  # built once, before the measured processes
    machine_before = busy()
    # two modes' processes at a time, side by side (each one's resident memory is its own; both
    # step times are slowed alike), and the swaps and version sizes meanwhile in this one
    with ThreadPoolExecutor(2) as pool:
        futures = {mode: pool.submit(in_fresh_process, mode) for mode in MODES}
        swaps = swap_figures("cpu")
        gc.collect()
        sizes = {shape: adapter_version_bytes(shape) for shape in ("midsize", "qwen3_0_6b")}
        modes = {mode: future.result() for mode, future in futures.items()}
    found = ratios(modes, swaps)
    midsize = model_config("midsize")
    sizes["largest_r_within_goal"] = {label: largest_rank_within(midsize, targets, GOALS["snapshot_ratio"],
                                                                 sizes["midsize"]["parameters"])
                                      for label, targets in TARGET_SETS.items()}
    figures = {"modes": modes, "swaps": swaps, "version_sizes": sizes, "ratios": found, "goals": GOALS,
               "goals_met": goals_met(found), "machine_load": [machine_before, busy()]}
    write_result("lora", figures, markdown(figures))
    return figures


def markdown(figures: dict) -> str:
    modes, swaps, found, sizes = figures["modes"], figures["swaps"], figures["ratios"], figures["version_sizes"]
    labels = {"full": "full fine-tuning", "lora": f"LoRA r={R}", "full_checkpointing": "full fine-tuning, checkpointing",
              "lora_checkpointing": f"LoRA r={R}, checkpointing"}
    rows = [[labels[mode], m["trainable_parameters"], m["version"]["snapshot_bytes"], m["version"]["delta_bytes"],
             m["step_memory_mb"], m["step_seconds"]] for mode, m in modes.items()]
    table = markdown_table(["mode", "trainable parameters", "snapshot bytes (bf16)", "delta bytes", "step memory MB",
                            "step seconds"], rows)
    size_rows = [[shape, f"{sizes[shape]['parameters']:,}", label, ", ".join(a["targets"]), f"{a['elements']:,}",
                  a["snapshot_bytes"], f"{a['snapshot_ratio']:.2%}", f"{a['arithmetic_ratio']:.2%}"]
                 for shape in ("midsize", "qwen3_0_6b") for label, a in sizes[shape]["adapters"].items()]
    size_table = markdown_table(["shape", "parameters", f"adapter (r={R})", "targets", "adapter elements",
                                 "adapter snapshot bytes", "of the whole snapshot", "r(in+out) arithmetic"], size_rows)
    largest = ", ".join(f"{label}: r <= {r}" for label, r in sizes["largest_r_within_goal"].items())
    load = figures.get("machine_load", [{}])[0]
    busy_note = (f"The machine was busy (1-minute load {load.get('load_average_1m')} on {load.get('cpu_count')} cores, "
                 "other sessions running): absolute times are disturbed, the ratios less so; re-run on a quiet machine "
                 "for absolute figures.") if load.get("busy") else "The machine was quiet."
    full = modes["full"]
    return (f"# LoRA against full fine-tuning\n\n{__doc__.strip()}\n\nModel: {full['parameters']:,} parameters; adapter "
            f"r={R}, alpha={ALPHA:g} on {', '.join(TARGETS)}. {busy_note}\n\n{table}\n"
            f"- Snapshot: LoRA {found['snapshot_ratio']:.2%} of full (goal <= {GOALS['snapshot_ratio']:.0%}); one step's "
            f"delta {found['delta_ratio']:.2%} of full's (every adapter element moves each step).\n"
            f"- Step memory on top of the loaded model: {found['step_memory_ratio']:.2f}x of full without gradient "
            f"checkpointing, {found['step_memory_ratio_checkpointing']:.2f}x with it in both (goal <= "
            f"{GOALS['step_memory_ratio']}x); step time {found['step_time_ratio']:.2f}x.\n"
            f"- Sampler swap: adapter unmerged {swaps['swap_unmerged_s'] * 1e3:.2f} ms, merged "
            f"{swaps['swap_merged_s'] * 1e3:.2f} ms, a whole version {swaps['swap_full_s'] * 1e3:.2f} ms "
            f"({found['swap_unmerged_over_full']:.3f}x and {found['swap_merged_over_full']:.3f}x of it).\n"
            f"- Generation merged over unmerged: {found['generate_merged_over_unmerged']:.2f}x the time.\n\n"
            f"## Version size by target modules and shape\n\n{size_table}\n"
            f"- The largest rank whose adapter is at most {GOALS['snapshot_ratio']:.0%} of the mid-size model: {largest}.\n")


if __name__ == "__main__":
    import torch

    torch.set_num_threads(2)
    print(json.dumps(step_figures(**json.loads(sys.argv[1]))))
