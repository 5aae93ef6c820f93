"""Where a learner step's time goes ("Real-scale peers": the learner at >= 30% of a GPU's bf16 peak in
model FLOPs at Qwen3-0.6B's shape). `breakdown(core, groups, device)` times one `LearnerCore.step` by
phase (the core's `phase_mark` hook: CUDA events on a GPU, so the phases are the device's; the host's
clock on a CPU), then profiles another (torch.profiler): the device time of the head's passes and of
the optimizer (profiler ranges in swarm/logprobs.py and swarm/training.py), kernels by kind (matmul,
attention, elementwise, reduction, optimizer, compiled) and the top ones, kernel launches, aten
calls, casts and reads back to the host. The GPU check's learner section (benchmarks/gpu_sections.py)
calls it at full shape for each option set.

`python -m benchmarks learner_breakdown`: on this machine's CPU at a reduced shape: Qwen3-0.6B's layers,
heads and 151,936-token vocabulary with GEPO_BREAKDOWN_LAYERS (2) layers, 4 completions of 256 tokens
after a 128-token prompt, float32, log-probs in chunks of 1,024; each option set's step time over the
eager one's, alternating, in the same process. A CPU says little about a GPU's time (its matmuls
dominate); the counts (launches, casts, read-backs) carry over.
"""

from __future__ import annotations

import os
import re
import statistics
import time

import torch

from benchmarks.common import machine, markdown_table, write_result

# kernel kinds by name (first match); what matches none is "other"
KERNEL_KINDS = (("compiled", r"^triton_|_triton_"), ("attention", r"flash|fmha|attention|attn"),
                ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|sm\d+_.*(?:tensorop|mma)|matmul"),
                ("optimizer", r"adam|multi_tensor_apply"), ("reduction", r"reduce|logsumexp|softmax|norm"),
                ("elementwise", r"elementwise|vectorized|copy|cast|fill|index|scatter|gather|cat"))
RANGES = ("learner/forward", "learner/backward", "learner/optimizer", "logprobs/head_forward", "logprobs/head_backward")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


class PhaseClock:
    """The step's phases as LearnerCore marks them, timed on the device (CUDA events: when the stream
    reached each mark) or, on a CPU, on the host; `seconds()`: each phase's total over micro-batches."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []

    def mark(self, phase: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((phase, event))
        else:
            self.marks.append((phase, time.perf_counter()))

    def seconds(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        totals: dict[str, float] = {}
        for (phase, start), (_, end) in zip(self.marks, self.marks[1:]):
            spent = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            totals[phase] = totals.get(phase, 0.0) + spent
        return totals


def kind_of(kernel: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if re.search(pattern, kernel, re.IGNORECASE)), "other")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_phases(core, groups, device: torch.device) -> dict:
    """One step's wall time and its phases (see PhaseClock)."""
    clock = PhaseClock(device)
    core.phase_mark = clock.mark
    try:
        _sync(device)
        started = time.perf_counter()
        core.step(groups)
        _sync(device)
        wall = time.perf_counter() - started
    finally:
        core.phase_mark = None
    return {"step_s": wall, "phases_s": clock.seconds()}


def profiled(core, groups, device: torch.device, top: int = 12) -> dict:
    """One step under torch.profiler: device time by range and kernel kind, the top kernels (CPU: the
    top ops by self time), and counts of launches, aten calls, casts and reads back to the host."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        core.step(groups)
        _sync(device)
    events = prof.key_averages()
    by_name = {e.key: e for e in events if e.device_type == DeviceType.CPU}
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]

    def device_s(e) -> float:
        return getattr(e, "self_device_time_total", 0.0) / 1e6

    def count(*names: str) -> int:
        return sum(by_name[n].count for n in names if n in by_name)

    figures = {
        "aten_calls": sum(e.count for e in events if e.device_type == DeviceType.CPU and e.key.startswith("aten::")),
        "casts": count("aten::_to_copy"),
        "item_reads": count("aten::_local_scalar_dense"),  # float(t), int(t), t.item(): each waits for the device
        "ranges": {name: {"calls": by_name[name].count, "host_s": by_name[name].cpu_time_total / 1e6,
                          "device_s": getattr(by_name[name], "device_time_total", 0.0) / 1e6}
                   for name in RANGES if name in by_name},
    }
    if cuda:
        kinds: dict[str, float] = {}
        for e in kernels:
            kinds[kind_of(e.key)] = kinds.get(kind_of(e.key), 0.0) + device_s(e)
        figures.update(
            kernel_launches=count("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"),
            host_syncs=count(*SYNC_CALLS), kernel_s=sum(kinds.values()), kernel_kinds_s=kinds,
            top=[{"kernel": e.key[:110], "kind": kind_of(e.key), "calls": e.count, "device_s": round(device_s(e), 4)}
                 for e in sorted(kernels, key=device_s, reverse=True)[:top]])
    else:
        ops = sorted((e for e in events if e.device_type == DeviceType.CPU and e.key.startswith("aten::")),
                     key=lambda e: e.self_cpu_time_total, reverse=True)
        figures["top"] = [{"op": e.key, "calls": e.count, "host_s": round(e.self_cpu_time_total / 1e6, 4)} for e in ops[:top]]
    return figures


def breakdown(core, groups, device: torch.device, *, top: int = 12) -> dict:
    """timed_phases then profiled, on a core that has stepped once already (AdamW's state exists, and
    anything compiled is compiled)."""
    timing = timed_phases(core, groups, device)
    return {**timing, "profile": profiled(core, groups, device, top=top)}


def summary(b: dict) -> str:
    """One line of a breakdown, for logs."""
    phases = ", ".join(f"{k} {v:.3f}" for k, v in b["phases_s"].items())
    prof = b["profile"]
    launches = f"{prof['kernel_launches']} launches, {prof['host_syncs']} syncs, " if "kernel_launches" in prof else ""
    return f"step {b['step_s']:.3f} s ({phases}); {launches}{prof['aten_calls']} aten calls, {prof['casts']} casts"


# ------------------------------------------------------------------------------------------ CPU run

LAYERS = int(os.environ.get("GEPO_BREAKDOWN_LAYERS", 2))
ROWS, PROMPT, COMPLETION, CHUNK = 4, 128, 256, 1024
REPEATS = int(os.environ.get("GEPO_BREAKDOWN_REPEATS", 3))
# (torch_compile, AdamW's fused flag): one core switches between them before each step (one AdamW state:
# three would not fit this machine's memory at the real vocabulary)
OPTION_SETS = {"eager": ("off", None), "fused_adamw": ("off", True), "compile_head": ("head", True)}


def use_options(core, name: str) -> None:
    core.torch_compile, fused = OPTION_SETS[name]
    for group in core.optimizer.param_groups:
        group["fused"], group["foreach"] = fused, None


def run() -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from benchmarks.gpu_setup import PAD, QWEN3_0_6B, Shape, synthetic_groups
    from swarm.training import LearnerCore

    device = torch.device("cpu")
    torch.manual_seed(0)
    config = Qwen3Config(**{**QWEN3_0_6B, "num_hidden_layers": LAYERS}, bos_token_id=PAD,
                         eos_token_id=QWEN3_0_6B["vocab_size"] - 1, pad_token_id=PAD)
    groups = synthetic_groups(Shape(1, ROWS, PROMPT, COMPLETION), config.vocab_size)
    core = LearnerCore(Qwen3ForCausalLM(config), PAD, learning_rate=1e-6, lr_warmup_steps=0, logprob_chunk=CHUNK)
    for name in OPTION_SETS:
        use_options(core, name)
        started = time.perf_counter()
        core.step(groups)  # AdamW's state; compiles what is compiled
        print(f"[learner_breakdown] {name}: first step {time.perf_counter() - started:.1f} s", flush=True)
    seconds: dict[str, list[float]] = {name: [] for name in OPTION_SETS}
    for repeat in range(REPEATS):
        for name in OPTION_SETS:
            use_options(core, name)
            seconds[name].append(timed_phases(core, groups, device)["step_s"])
        print(f"[learner_breakdown] repeat {repeat + 1}/{REPEATS}: "
              + ", ".join(f"{n} {s[-1]:.2f} s" for n, s in seconds.items()), flush=True)
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    details = {}
    for name in OPTION_SETS:
        use_options(core, name)
        details[name] = breakdown(core, groups, device)
    figures = {"machine": machine(), "load_average": os.getloadavg(), "layers": LAYERS, "rows": ROWS, "prompt_tokens": PROMPT,
               "completion_tokens": COMPLETION, "logprob_chunk": CHUNK, "repeats": REPEATS, "seconds": seconds,
               "over_eager": {name: medians[name] / medians["eager"] for name in OPTION_SETS}, "breakdown": details}
    write_result("learner_breakdown", figures, markdown(figures))
    return figures


def markdown(f: dict) -> str:
    rows = [[name, f"{statistics.median(f['seconds'][name]):.2f}", f"{f['over_eager'][name]:.3f}", b["profile"]["aten_calls"],
             b["profile"]["casts"], b["profile"]["item_reads"],
             ", ".join(f"{k} {v:.2f}" for k, v in b["phases_s"].items())] for name, b in f["breakdown"].items()]
    tops = "\n".join(f"### {name}\n\n" + markdown_table(["op", "calls", "host s"], [[t["op"], t["calls"], t["host_s"]]
                                                                                   for t in b["profile"]["top"]])
                     for name, b in f["breakdown"].items())
    return (f"# Learner step breakdown (CPU, reduced shape)\n\n{__doc__.strip()}\n\nMachine: {f['machine']}; load average "
            f"{', '.join(f'{x:.1f}' for x in f['load_average'])} on its 2 cores (busy: other work shares them, so only "
            f"ratios taken in one process mean anything). {f['layers']} layers, {f['rows']} x ({f['prompt_tokens']} + "
            f"{f['completion_tokens']}) tokens; medians of {f['repeats']} alternating steps.\n\n"
            + markdown_table(["options", "median s", "over eager", "aten calls", "casts", "reads to host", "phases (s)"], rows)
            + f"\n## Top ops by host time (one profiled step)\n\n{tops}")

