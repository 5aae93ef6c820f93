"""The sections of `python -m benchmarks.gpu_check` (see its docstring), each a function of a `Run`
that returns its figures, at the sizes of gpu_setup.py.
"""
from __future__ import annotations

import copy
import gc
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from swarm.fabric.weights.delta import THREADS, apply_payload_verified, encode_delta, encode_snapshot, state_hash
from swarm.generation import SamplingParams
from swarm.generation.transformers_backend import TransformersBackend
from swarm.logprobs import completion_logprobs
from swarm.rollouts import RolloutGroup
from swarm.training import LearnerCore
from swarm.verification import completion_gaps

from benchmarks.gpu_setup import (
    GAP_GOAL_COMPLETIONS, PAD, PeakMemory, Run, Shape, Variant, build_model, completion_mask, eos_of,
    free_memory, parameter_bytes, peak_tflops, quantile, random_prompts, stand_in_tokenizer, sync,
    synthetic_groups, timed,
)

# --------------------------------------------------------------------------------------------- sections

def demo(run: Run) -> dict:
    """`swarm demo` in its own processes; SIGINT (its Ctrl-C, which stops every peer) when over budget."""
    run_dir = Path(tempfile.mkdtemp(prefix="gpu_check_demo_")) / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not run.cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the peers' --device auto then takes the CPU
    cmd = [sys.executable, "-m", "swarm.cli", "demo", "--run-dir", str(run_dir), *run.size.demo]
    run.say(" ".join(cmd[2:]))
    log = run_dir.with_name("demo.log")
    started = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            proc.wait(timeout=max(run.left() - 25, 5))  # leaves its Ctrl-C time to stop every peer
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    steps_file = run_dir / "learner" / "steps.jsonl"
    steps = steps_file.read_text().splitlines() if steps_file.exists() else []
    evals = json.loads((run_dir / "evals.json").read_text()) if (run_dir / "evals.json").exists() else []
    figures = {"command": " ".join(cmd[2:]), "returncode": proc.returncode, "demo_s": time.time() - started,
               "learner_steps": len(steps), "peers_device": "cuda" if run.cuda else "cpu"}
    if evals:
        figures.update(before=evals[0], after=evals[-1])
    if proc.returncode != 0:  # the run directory is kept, to be read
        figures["error"] = f"swarm demo exited with {proc.returncode} after {figures['demo_s']:.0f} s " \
                           f"(budget {run.size.budgets['demo']:.0f} s); its output ends with:\n{log.read_text()[-1500:]}"
        figures["run_dir"] = str(run_dir)
    else:
        shutil.rmtree(run_dir.parent, ignore_errors=True)
    return figures


def sampler(run: Run) -> dict:
    model = build_model(run).to(run.torch_dtype).eval()
    backend = TransformersBackend(model, stand_in_tokenizer(model))
    shape = run.size.sampler
    ids, mask = random_prompts(shape, model.config.vocab_size, run.device)
    params = SamplingParams(num_completions=shape.completions, max_new_tokens=shape.new_tokens)
    weights = torch.cuda.memory_allocated() if run.cuda else None  # CUDA graphs keep some of a call's memory after it
    with PeakMemory(run.device) as warm:
        (_, warm_s) = timed(run, backend.sample, ids, mask, params)  # on CUDA: compiles the static-cache step
    run.say(f"warm-up {warm_s:.1f} s (static KV cache: {backend.static_cache})")
    best, tokens, memory = math.inf, 0, None
    for attempt in range(3):
        if attempt and run.left() < 2 * best:
            break
        torch.manual_seed(attempt)
        with PeakMemory(run.device) as meter:
            (new_tokens, _), seconds = timed(run, backend.sample, ids, mask, params)
        if seconds < best:
            best, memory = seconds, meter.peak - weights if run.cuda else meter.above
            tokens = int(completion_mask(new_tokens, eos_of(model)).sum())
    return {"rows": shape.rows, "prompt_tokens": shape.prompt_tokens, "new_tokens": shape.new_tokens, "dtype": run.dtype,
            "static_kv_cache": backend.static_cache, "parameters": sum(p.numel() for p in model.parameters()),
            "weights_bytes": parameter_bytes(model), "warmup_s": warm_s, "sample_s": best, "completion_tokens": tokens,
            "tokens_per_s": tokens / best, "peak_bytes_above_weights": memory,
            "warmup_peak_bytes_above_weights": warm.peak - weights if run.cuda else warm.above,
            "memory_source": "torch.cuda.max_memory_allocated" if run.cuda else "process VmHWM - VmRSS (CPU)"}


def set_checkpointing(model, on: bool) -> None:
    """LearnerCore turns checkpointing on; off it needs turning explicitly (names changed in transformers 5)."""
    is_on = getattr(model, "is_activation_checkpointing", None)
    if not on and (model.is_gradient_checkpointing if is_on is None else is_on):
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()


def flops_shares(run: Run, model, tokens: int, seconds: float, checkpointing: bool) -> dict:
    """Model FLOPs (6 x parameters x tokens), the hardware's (8 x with checkpointing) and the model's with
    attention (PaLM's 6N + 12 x layers x heads x head_dim x sequence per token; arXiv:2204.02311, appendix B),
    each over the GPU's dense bf16 peak; None without a known peak."""
    peak = peak_tflops(run)
    params = sum(p.numel() for p in model.parameters())
    shape, config = run.size.learner, model.config
    sequence = shape.prompt_tokens + shape.new_tokens
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * sequence
    flops = {"model_flops_share": 6 * params * tokens, "hardware_flops_share": (8 if checkpointing else 6) * params * tokens,
             "model_flops_share_with_attention": (6 * params + attention) * tokens}
    return {k: v / seconds / (peak * 1e12) if peak else None for k, v in flops.items()}


def learner_config(run: Run, model, groups: list[RolloutGroup], micro: int, checkpointing: bool,
                   variant: Variant | None = None) -> dict:
    """One configuration's step: a warm-up step (AdamW's state; compiling), then one timed; with a
    variant, its options and its breakdown (benchmarks/learner_breakdown.py: phases, kernels) too."""
    from benchmarks.learner_breakdown import breakdown, summary

    free_memory(run.device)  # what a previous configuration's out-of-memory error held
    set_checkpointing(model, checkpointing)
    autocast = run.torch_dtype if run.dtype != "float32" else None
    shape = run.size.learner
    tokens = shape.rows * (shape.prompt_tokens + shape.new_tokens)
    row = {"micro_batch_groups": micro, "gradient_checkpointing": checkpointing, "tokens_per_step": tokens}
    options = {}
    if variant is not None:
        options = {"torch_compile": variant.torch_compile, "optimizer_implementation": variant.optimizer_implementation}
        row = {"variant": variant.name, **row, **options}
    core = LearnerCore(model, PAD, learning_rate=1e-6, lr_warmup_steps=0, micro_batch_groups=micro,
                       gradient_checkpointing=checkpointing, autocast_dtype=autocast, **options)
    row["fused_adamw"] = bool(core.optimizer.defaults.get("fused"))
    details = None
    try:
        (_, row["first_step_s"]) = timed(run, core.step, groups)  # warm-up: allocates AdamW's state, compiles
        with PeakMemory(run.device) as meter:
            _, seconds = timed(run, core.step, groups)
        if variant is not None:
            details = breakdown(core, groups, torch.device(run.device))
            run.say(f"{variant.name}, micro-batch {micro}, checkpointing {checkpointing}: {summary(details)}")
    except torch.cuda.OutOfMemoryError as exc:
        return {**row, "out_of_memory": str(exc).splitlines()[0][:300]}
    finally:
        del core
        model.zero_grad(set_to_none=True)
        free_memory(run.device)
    return {**row, "step_s": seconds, "tokens_per_s": tokens / seconds, "peak_bytes": meter.peak,
            "step_bytes_above_state": meter.above, **flops_shares(run, model, tokens, seconds, checkpointing),
            **({"breakdown": details} if details is not None else {})}


def learner(run: Run) -> dict:
    model = build_model(run)
    groups = synthetic_groups(run.size.learner, model.config.vocab_size)
    gc.freeze()  # what exists now (modules, the model) is never garbage: each configuration's collection skips it
    shape = run.size.learner
    about_run = {"parameters": sum(p.numel() for p in model.parameters()), "master_dtype": "float32",
                 "autocast": run.dtype if run.dtype != "float32" else None, "groups_per_step": shape.prompts,
                 "completions_per_group": shape.completions, "prompt_tokens": shape.prompt_tokens,
                 "completion_tokens": shape.new_tokens, "peak_tflops": peak_tflops(run),
                 "gpu": torch.cuda.get_device_name() if run.cuda else None}
    rows = []
    for checkpointing in (False, True):
        for micro in run.size.micro_batches:
            if run.left() < 5:
                rows.append({"micro_batch_groups": micro, "gradient_checkpointing": checkpointing,
                             "skipped": "the section's time budget was spent"})
                continue
            rows.append(learner_config(run, model, groups, micro, checkpointing))
            run.keep_partial({**about_run, "configs": rows})
            run.say(f"micro-batch {micro}, checkpointing {checkpointing}: "
                    + (f"{rows[-1]['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in rows[-1] else "out of memory"))
    variants = []
    for v in run.size.learner_variants:
        about = {"variant": v.name, "micro_batch_groups": v.micro_batch_groups,
                 "gradient_checkpointing": v.gradient_checkpointing}
        if v.torch_compile != "off" and not run.cuda:
            variants.append({**about, "skipped": "compiling is judged on a GPU (tests/learning/test_learner_speed.py checks "
                                                 "its step on a CPU)"})
        elif run.left() < v.needs_s:
            variants.append({**about, "skipped": f"{run.left():.0f} s of the section's budget left, {v.needs_s:.0f} s needed"})
        else:
            run.keep_partial({**about_run, "configs": rows, "variants": variants + [{**about, "error": "did not finish"}]})
            try:  # a variant that fails (compiling, say) is recorded, and the others still run
                variants.append(learner_config(run, model, groups, v.micro_batch_groups, v.gradient_checkpointing, v))
            except Exception as exc:  # noqa: BLE001
                variants.append({**about, "error": f"{type(exc).__name__}: {exc}"[:1000]})
                run.say(f"variant {v.name} failed: {variants[-1]['error'][:300]}")
                continue
            run.keep_partial({**about_run, "configs": rows, "variants": variants})
            run.say(f"variant {v.name}, micro-batch {v.micro_batch_groups}, checkpointing {v.gradient_checkpointing}: "
                    + (f"{variants[-1]['tokens_per_s']:.0f} tokens/s, first step {variants[-1]['first_step_s']:.1f} s"
                       if "tokens_per_s" in variants[-1] else "out of memory"))
    return {**about_run, "configs": rows, "variants": variants}


def published(model, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The version a learner publishes: its state in bf16 (what GPU samplers run), on the host."""
    return {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).cpu() for k, v in model.state_dict().items()}


def delta(run: Run) -> dict:
    model = build_model(run)
    core = LearnerCore(model, PAD, learning_rate=1e-6, lr_warmup_steps=0,
                       autocast_dtype=run.torch_dtype if run.dtype != "float32" else None)
    before = published(model)
    _, step_s = timed(run, core.step, synthetic_groups(run.size.delta_step, model.config.vocab_size))
    new, publish_s = timed(run, published, model)
    payload, encode_s = timed(run, encode_delta, before, new, base_version=0, version=1)
    (version, state, digest, kind), apply_s = timed(run, apply_payload_verified, payload, before)
    expected, hash_s = timed(run, state_hash, new)
    if (version, kind, digest) != (1, "delta", expected):
        raise RuntimeError(f"the delta applied to version {version} ({kind}), hash {digest[:12]}, not {expected[:12]}")
    snapshot, snapshot_s = timed(run, encode_snapshot, new, 1)
    elements = sum(t.numel() for t in new.values())
    changed = sum(int((before[k] != new[k]).sum()) for k in new)
    snapshot_bytes = sum(t.numel() * t.element_size() for t in new.values())
    return {"parameters": sum(p.numel() for p in model.parameters()), "published_elements": elements,
            "learning_rate": 1e-6, "optimizer_step_s": step_s, "publish_s": publish_s, "changed_fraction": changed / elements,
            "delta_bytes": len(payload), "delta_fraction": len(payload) / snapshot_bytes, "snapshot_bytes": len(snapshot),
            "encode_s": encode_s, "apply_verify_s": apply_s, "state_hash_s": hash_s, "snapshot_encode_s": snapshot_s,
            "threads": THREADS}


def publish(run: Run) -> dict:
    """Learner steps/s with the background publisher (swarm/fabric/weights/publisher.py) on, against off,
    its encoding in a thread ("thread") and in a process of its own ("process": no GIL shared with the
    training thread's kernel launches): the training thread casts the weights to bf16 where they are once
    a step and goes on while the publisher takes them to the host, encodes, hashes and holds the version
    as the learner's VersionStore does. Modes alternate in blocks; the publisher finishes its last
    version between blocks (not counted); a block that would not fit the section's budget is not begun."""
    from swarm.fabric.weights.publisher import Publisher
    from swarm.fabric.weights.versions import VersionStore
    from swarm.tied_weights import unique_state

    shape, blocks, per_block = run.size.publish
    model = build_model(run)
    core = LearnerCore(model, PAD, learning_rate=1e-6, lr_warmup_steps=0, micro_batch_groups=shape.prompts,
                       gradient_checkpointing=True, autocast_dtype=run.torch_dtype if run.dtype != "float32" else None)
    groups = synthetic_groups(shape, model.config.vocab_size)
    publishers: dict[str, Publisher] = {}
    first_s: dict[str, float] = {}
    version = 0
    try:
        for isolation in ("thread", "process"):
            store = VersionStore(capacity=65, whole_states=1, cached_states=1, delta_budget=0.5)  # the learner's (peers/learner.py)
            publishers[isolation] = Publisher(store, on_published=lambda version, digest: None, isolation=isolation)
            _, first_s[isolation] = timed(run, publishers[isolation].publish_now, version,
                                          unique_state(model, torch.bfloat16, copy=True, on_host=False))
            publishers[isolation].busy_seconds = 0.0
        core.step(groups)  # warm-up: AdamW's state
        times: dict[str, list[float]] = {"off": [], "thread": [], "process": []}
        snapshot_s: dict[str, list[float]] = {"thread": [], "process": []}
        blocks_run = 0
        for _ in range(blocks):
            block_started = time.perf_counter()
            for mode in times:
                for _ in range(per_block):
                    sync(run.device)
                    started = time.perf_counter()
                    core.step(groups)
                    version += 1
                    if mode != "off":
                        copied = time.perf_counter()
                        publishers[mode].submit(version, unique_state(model, torch.bfloat16, copy=True, on_host=False))
                        snapshot_s[mode].append(time.perf_counter() - copied)
                    sync(run.device)
                    times[mode].append(time.perf_counter() - started)
                if mode != "off":
                    publishers[mode].wait()
            run.say("steps " + ", ".join(f"{mode} {t[-1]:.2f} s" for mode, t in times.items()))
            blocks_run += 1
            if run.left() < 1.2 * (time.perf_counter() - block_started) + 5:  # another block would not fit the budget
                break
    finally:
        for publisher in publishers.values():
            publisher.close()
    median = {mode: sorted(t)[len(t) // 2] for mode, t in times.items()}
    modes = list(publishers)
    return {"parameters": sum(p.numel() for p in model.parameters()), "tokens_per_step": shape.rows * (shape.prompt_tokens + shape.new_tokens),
            "blocks": blocks_run, "steps_per_block": per_block, "first_version_s": first_s,  # process: with the child's start
            "median_step_s": median, "thread_over_off": median["off"] / median["thread"],
            "process_over_off": median["off"] / median["process"],
            "snapshot_and_submit_s_median": {m: sorted(snapshot_s[m])[len(snapshot_s[m]) // 2] for m in modes},
            "published": {m: publishers[m].published - 1 for m in modes},
            "versions_skipped": {m: len(publishers[m].skipped) for m in modes},
            "publisher_busy_s": {m: publishers[m].busy_seconds for m in modes}, "goal": 0.95}


def on_bf16_grid(model) -> None:
    """Float32 weights that are bf16 values: what a learner's verifier loads from a published version."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


@torch.no_grad()
def recompute(model, ids, mask, new_tokens, comp_mask, rows: int) -> torch.Tensor:
    """The learner's float32 log-probs of the sampled tokens, `rows` sequences at a time."""
    return torch.cat([completion_logprobs(model, ids[s:s + rows], mask[s:s + rows], new_tokens[s:s + rows],
                                          comp_mask[s:s + rows], chunk=2048) for s in range(0, ids.size(0), rows)])


def gap_of(run: Run, learner_model, dtype: str, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    shape, per_call = run.size.gap, run.size.gap_rows_per_call
    sampler_model = copy.deepcopy(learner_model).to(getattr(torch, dtype))
    # dynamic KV cache, no compiled step: the static cache's step agrees with it (tests), and compiling
    # for two dtypes would cost more than sampling the completions does
    backend = TransformersBackend(sampler_model, stand_in_tokenizer(learner_model), static_cache=False)
    params = SamplingParams(num_completions=shape.completions, max_new_tokens=shape.new_tokens)
    gaps, token_max, tokens, sample_s, stopped = [], 0.0, 0, 0.0, False
    started = time.time()
    for start in range(0, ids.size(0), per_call):
        if start and run.left() < 1.5 * (time.time() - started) / (start / per_call) + 5:  # another call would not fit
            stopped = True
            break
        torch.manual_seed(start)
        (new_tokens, claimed), seconds = timed(run, backend.sample, ids[start:start + per_call], mask[start:start + per_call], params)
        sample_s += seconds
        comp_mask = completion_mask(new_tokens, eos_of(learner_model))
        recomputed = recompute(learner_model, ids[start:start + per_call], mask[start:start + per_call], new_tokens,
                               comp_mask, rows=max(1, per_call // 8))
        claimed = claimed.float() * comp_mask
        gaps += completion_gaps(claimed, recomputed, comp_mask).tolist()
        token_max = max(token_max, float(((claimed - recomputed).abs() * comp_mask).max()))
        tokens += int(comp_mask.sum())
    del backend, sampler_model
    free_memory(run.device)
    run.say(f"{dtype}: {len(gaps)} completions, gap max {max(gaps):.3g}")
    return {"completions": len(gaps), "tokens": tokens, "sample_s": sample_s, "gap_max": max(gaps),
            "gap_p999": quantile(gaps, 0.999), "gap_p99": quantile(gaps, 0.99), "gap_p50": quantile(gaps, 0.5),
            "token_gap_max": token_max, "stopped_by_budget": stopped,
            "goal_met": len(gaps) >= GAP_GOAL_COMPLETIONS if run.size.label == "full" else None}


def verification_gap(run: Run) -> dict:
    learner_model = build_model(run).eval()
    on_bf16_grid(learner_model)
    ids, mask = random_prompts(run.size.gap, learner_model.config.vocab_size, run.device, seed=1)
    shape = run.size.gap
    return {"completions_asked": shape.rows, "new_tokens": shape.new_tokens, "prompt_tokens": shape.prompt_tokens,
            "learner_dtype": "float32", "by_sampler_dtype": {d: gap_of(run, learner_model, d, ids, mask)
                                                              for d in ("bfloat16", "float16")}}


def word_tokenizer(vocab: int):
    """A tokenizer whose every id is a word ("t0" ... "t{vocab-1}"): vLLM decodes whatever a random
    policy samples, and prompts are plain text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="t1", pad_token=f"t{PAD}", eos_token=f"t{vocab - 1}")


def model_dir(run: Run, model, where: Path) -> dict:
    """The policy saved in the run's dtype with its word tokenizer; the tokenizer and config read back."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.to(run.torch_dtype).save_pretrained(where)
    word_tokenizer(model.config.vocab_size).save_pretrained(where)
    tokenizer, config = AutoTokenizer.from_pretrained(where), AutoConfig.from_pretrained(where)
    if tokenizer("t5 t9")["input_ids"] != [5, 9] or tokenizer.decode([7]) != "t7" or config.vocab_size != len(tokenizer):
        raise RuntimeError(f"the saved model directory {where} does not load back as saved")
    return {"bytes": sum(f.stat().st_size for f in where.iterdir()), "tokenizer_size": len(tokenizer)}


def vllm_gap(backend, learner_model, state: dict, prompts: list[str], run: Run) -> float:
    learner_model.load_state_dict({k: v.to(run.device) for k, v in state.items()}, strict=True)
    gens = backend.generate(prompts, SamplingParams(num_completions=2, max_new_tokens=32, seed=3))
    gaps = []
    for gen in gens:
        for tokens, claimed in zip(gen.completion_ids, gen.completion_logprobs):
            ids = torch.tensor([gen.prompt_ids], device=run.device)
            comp = torch.tensor([tokens], device=run.device)
            ones = torch.ones_like(comp, dtype=torch.float)
            recomputed = recompute(learner_model, ids, torch.ones_like(ids), comp, ones, rows=1)
            gaps += completion_gaps(torch.tensor([claimed], device=run.device), recomputed, ones).tolist()
    return max(gaps)


def vllm_sampler(run: Run) -> dict:
    import importlib.util

    model = build_model(run)
    with tempfile.TemporaryDirectory(prefix="gpu_check_vllm_") as where:
        held = published(model, run.torch_dtype)  # what the saved directory holds
        directory = model_dir(run, copy.deepcopy(model), Path(where))
        if not run.cuda or importlib.util.find_spec("vllm") is None:
            return {"skipped": f"vLLM runs on CUDA only (--device {run.device})" if not run.cuda
                    else "vllm is not installed (pip install -e '.[vllm]')", "model_dir_checked": directory}
        return {"model_dir_checked": directory, **vllm_figures(run, model, held, where)}


def vllm_figures(run: Run, model, held: dict[str, torch.Tensor], where: str) -> dict:
    from swarm.generation.vllm_backend import VLLMBackend

    shape = run.size.vllm
    free_memory(run.device)  # vLLM sizes its share from the device's free memory
    free_before = torch.cuda.mem_get_info()[0]
    backend, start_s = timed(run, VLLMBackend, where, dtype=run.dtype, gpu_memory_utilization=0.35,
                             max_model_len=shape.prompt_tokens + shape.new_tokens + 64)
    engine_bytes = free_before - torch.cuda.mem_get_info()[0]
    ids, _ = random_prompts(Shape(shape.prompts, 1, shape.prompt_tokens, 0), model.config.vocab_size, "cpu")
    prompts = [" ".join(f"t{i}" for i in row) for row in ids.tolist()]
    params = SamplingParams(num_completions=shape.completions, max_new_tokens=shape.new_tokens, seed=0)
    backend.generate(prompts[:2], params)
    gens, seconds = timed(run, backend.generate, prompts, params)
    tokens = sum(g.num_tokens() for g in gens)
    run.say(f"{tokens / seconds:.0f} tokens/s; in-place update ...")
    noise = torch.Generator().manual_seed(1)
    new = {k: (v.float() + 0.01 * torch.randn(v.shape, generator=noise)).to(v.dtype) for k, v in held.items()}
    if model.config.tie_word_embeddings:
        new["lm_head.weight"] = new["model.embed_tokens.weight"]
    _, update_s = timed(run, backend.load_state_dict, new, previous=held)  # raises where the engine did not take it
    learner_model = model.float().eval()
    gap_new = vllm_gap(backend, learner_model, new, prompts[:4], run)
    gap_old = vllm_gap(backend, learner_model, held, prompts[:4], run)
    return {"engine_start_s": start_s, "engine_gpu_bytes": engine_bytes,
            "gpu_memory_utilization": 0.35, "completion_tokens": tokens, "generate_s": seconds, "tokens_per_s": tokens / seconds,
            "update_route": backend.route, "update_s": update_s, "update_checked": True,
            "gap_max_to_new_weights": gap_new, "gap_max_to_old_weights": gap_old}


SECTION_FUNCTIONS: dict[str, Callable[[Run], dict]] = {
    "demo": demo, "sampler": sampler, "learner": learner, "delta": delta, "verification_gap": verification_gap,
    "publish": publish, "vllm_sampler": vllm_sampler}


# --------------------------------------------------------------------------------------------- running
