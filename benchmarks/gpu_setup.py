"""What the sections of `python -m benchmarks.gpu_check` share: the sizes they run at (Qwen3-0.6B's
shape, FULL; every learner variant, LEARNER_ONLY; a tiny one on CPU, SMALL, `--small`), the `Run`
each is given, and the helpers they measure with (models of random weights, synthetic prompts and
groups, timing, peak memory, the GPU's peak FLOPs). The sections are in gpu_sections.py.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Callable, NamedTuple

import torch

from swarm.rollouts import RolloutGroup

SECTIONS = ("demo", "sampler", "learner", "delta", "verification_gap", "publish", "vllm_sampler")
PAD = 0
QWEN3_0_6B = dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, max_position_embeddings=40_960, tie_word_embeddings=True)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True)
# dense bf16 tensor-core peak, TFLOPS, by a part of torch.cuda.get_device_name() (first match)
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0),
                    ("L4", 121.0), ("RTX 4090", 165.0))
GAP_GOAL_COMPLETIONS = 1000


class Variant(NamedTuple):
    """A learner configuration the learner section measures with its breakdown (benchmarks/learner_breakdown.py)."""

    name: str
    micro_batch_groups: int
    gradient_checkpointing: bool
    torch_compile: str  # TrainingSettings.torch_compile
    optimizer_implementation: str  # TrainingSettings.optimizer_implementation
    needs_s: float  # seconds of the section's budget it must find left to begin (compiling included)


# Last session's best configuration as it ran then (foreach AdamW: torch's default on CUDA), then each speed
# option on top of the one before; "all" compiles the model's layers for good, so its variants come last.
# Compiled layers keep fewer activations for backward, so 4 groups without checkpointing may fit.
LEARNER_VARIANTS = (Variant("eager", 2, False, "off", "foreach", 10), Variant("fused_adamw", 2, False, "off", "fused", 10),
                    Variant("compile_head", 2, False, "head", "fused", 40), Variant("compile_all", 2, False, "all", "fused", 120),
                    Variant("compile_all", 4, False, "all", "fused", 60), Variant("compile_all", 4, True, "all", "fused", 60))
# The whole check must end within 8 minutes (issue 43; its sections took 400 s on an H100), which leaves
# the learner a minute and a half: the sweep of micro-batches, the baseline and the compiled head (with
# fused AdamW). Compiling the layers takes two minutes more: `--sections learner` alone runs every
# variant above (LEARNER_ONLY below).
QUICK_LEARNER_VARIANTS = (LEARNER_VARIANTS[0], LEARNER_VARIANTS[2])


class Shape(NamedTuple):
    prompts: int  # prompts, or groups
    completions: int  # per prompt
    prompt_tokens: int
    new_tokens: int

    @property
    def rows(self) -> int:
        return self.prompts * self.completions


@dataclass(frozen=True)
class Size:
    label: str
    model: dict
    sampler: Shape
    learner: Shape  # groups per step; micro-batches of each of `micro_batches` groups
    micro_batches: tuple[int, ...]
    learner_variants: tuple[Variant, ...]  # each with its breakdown; CPU (--small): compiling is left to a GPU
    delta_step: Shape
    gap: Shape
    gap_rows_per_call: int
    vllm: Shape
    publish: tuple[Shape, int, int]  # a step's groups (micro-batch: all of them), blocks per mode, steps a block
    demo: tuple[str, ...]
    budgets: dict[str, float]  # seconds per section; the whole check stops at `total_s`
    total_s: float


FULL = Size("full", QWEN3_0_6B, sampler=Shape(16, 8, 128, 256), learner=Shape(4, 8, 128, 1024), micro_batches=(1, 2, 4),
            learner_variants=QUICK_LEARNER_VARIANTS,
            delta_step=Shape(2, 4, 64, 128), gap=Shape(128, 8, 32, 256), gap_rows_per_call=512, vllm=Shape(16, 8, 128, 256),
            publish=(Shape(4, 8, 128, 1024), 2, 3), demo=("--steps", "5", "--groups-per-step", "16", "--eval-problems", "50"),
            budgets=dict(demo=110, sampler=80, learner=90, delta=40, verification_gap=110, publish=65, vllm_sampler=100),
            total_s=480)
# `--sections learner`: every variant, in one call of under 8 minutes
LEARNER_ONLY = replace(FULL, label="full, learner variants", learner_variants=LEARNER_VARIANTS,
                       budgets={**FULL.budgets, "learner": 450}, total_s=470)
SMALL = Size("small", TINY, sampler=Shape(2, 2, 8, 8), learner=Shape(4, 2, 8, 16), micro_batches=(1, 2, 4),
             learner_variants=LEARNER_VARIANTS,
             delta_step=Shape(2, 2, 8, 8), gap=Shape(3, 2, 8, 8), gap_rows_per_call=4, vllm=Shape(2, 2, 8, 8),
             publish=(Shape(2, 2, 8, 16), 1, 2), demo=("--steps", "2", "--groups-per-step", "2", "--num-generations", "2", "--samplers", "1",
                   "--prompts-per-round", "2", "--eval-problems", "4", "--eval-samples", "1"),
             # room for a CI machine that runs the other lane of tests beside it (the demo alone takes 25-50 s)
             budgets=dict(demo=120, sampler=40, learner=40, delta=40, verification_gap=40, publish=30, vllm_sampler=40),
             total_s=330)


@dataclass
class Run:
    """What a section is given: the size, where it runs, and its clock."""

    size: Size
    device: str
    dtype: str  # the samplers' dtype and the learner's autocast ("float32": none)
    t0: float  # when the whole check started (progress lines count from it)
    deadline: float  # when this section should be done (time.time())
    section: str = ""
    # the section's figures so far, kept where a kill past the budget leaves them (gpu_check.run_section_here)
    keep_partial: Callable[[dict], None] = lambda figures: None

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def left(self) -> float:
        return self.deadline - time.time()

    def say(self, text: str) -> None:
        print(f"[gpu_check {time.time() - self.t0:6.1f}s] {self.section}: {text}", flush=True)


# --------------------------------------------------------------------------------------------- helpers

def build_model(run: Run, seed: int = 0) -> torch.nn.Module:
    """A Qwen3 policy of the size's shape with random (seeded) float32 weights, made on the device."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    vocab = run.size.model["vocab_size"]
    config = Qwen3Config(**run.size.model, bos_token_id=PAD, eos_token_id=vocab - 1, pad_token_id=PAD)
    with torch.device(run.device):
        return Qwen3ForCausalLM(config)


def eos_of(model) -> int:
    return model.config.vocab_size - 1  # a random policy samples it about once in 150,000 tokens


def stand_in_tokenizer(model) -> SimpleNamespace:
    return SimpleNamespace(pad_token_id=PAD, eos_token_id=eos_of(model), padding_side="left")  # all sample() reads


def random_prompts(shape: Shape, vocab: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, prompt tokens) ids, each prompt repeated for its completions, and the attention mask."""
    ids = torch.randint(1, vocab - 1, (shape.prompts, shape.prompt_tokens), generator=torch.Generator().manual_seed(seed))
    ids = ids.repeat_interleave(shape.completions, dim=0).to(device)
    return ids, torch.ones_like(ids)


def completion_mask(new_tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """1.0 up to and including each row's first EOS (generate pads after it)."""
    is_eos = (new_tokens == eos).long()
    return ((is_eos.cumsum(-1) - is_eos) == 0).float()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(run: Run, fn: Callable, *args, **kwargs):
    sync(run.device)
    started = time.perf_counter()
    out = fn(*args, **kwargs)
    sync(run.device)
    return out, time.perf_counter() - started


def status_kib(name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(name + ":"))
    except (OSError, StopIteration):
        return None


class PeakMemory:
    """Peak memory while inside, absolute and above what was held on entry: CUDA's allocator, or on
    a CPU the process's resident peak (VmHWM, reset through /proc/self/clear_refs); None elsewhere."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.base: int | None = None
        self.peak: int | None = None

    def __enter__(self) -> "PeakMemory":
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            rss = status_kib("VmRSS")
            self.base = None if rss is None else rss * 1024
        except OSError:
            self.base = None
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        elif self.base is not None:
            hwm = status_kib("VmHWM")
            self.peak = None if hwm is None else hwm * 1024

    @property
    def above(self) -> int | None:
        return None if self.peak is None or self.base is None else self.peak - self.base


def free_memory(device: str) -> None:
    """What a CUDA out-of-memory error's frames held, back to the device (a CPU's allocator needs no
    collection: one costs a second or more with transformers loaded, so it is skipped there)."""
    if device.startswith("cuda"):
        gc.collect()
        torch.cuda.empty_cache()


def parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def peak_tflops(run: Run) -> float | None:
    if not run.cuda or run.dtype not in ("bfloat16", "float16"):
        return None
    name = torch.cuda.get_device_name().lower()
    return next((tflops for part, tflops in PEAK_BF16_TFLOPS if part.lower() in name), None)


def synthetic_groups(shape: Shape, vocab: int, seed: int = 0) -> list[RolloutGroup]:
    """Random tokens, full length, rewards half 1 and half 0; q = the uniform distribution's, about
    what a random policy gives (so the loss is near on-policy)."""
    g = torch.Generator().manual_seed(seed)
    uniform = -math.log(vocab)
    return [RolloutGroup(f"p{i}", torch.randint(1, vocab - 1, (shape.prompt_tokens,), generator=g).tolist(),
                         torch.randint(1, vocab - 1, (shape.completions, shape.new_tokens), generator=g).tolist(),
                         [[uniform] * shape.new_tokens for _ in range(shape.completions)],
                         [float(c % 2) for c in range(shape.completions)], version=0, sampler_id="gpu_check")
            for i in range(shape.prompts)]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
