"""Every GPU claim of the project, checked by one command: `python -m benchmarks.gpu_check`.

Sections, each in a fresh process under its own time budget (one that fails, hangs or runs out of
memory is recorded, with its error, and the others still run; GPU memory peaks are the section's own):
- demo: `swarm demo` end to end (bootstrap, learner and samplers as processes; their `--device auto`
  takes CUDA where present), with fewer steps and held-out problems than its defaults;
- sampler: `TransformersBackend.sample` at Qwen3-0.6B's shape (random weights, 151,936-token
  vocabulary): completion tokens/s and peak memory above the weights;
- learner: `LearnerCore.step` at that shape, float32 master weights under bf16 autocast on a GPU:
  tokens/s, peak memory and share of the GPU's peak bf16 FLOPs, micro-batches of 1, 2 and 4 groups,
  gradient checkpointing off and on; then variants, each speed option on top of the one before, each
  with where its step's time goes (phases, kernels): the full check runs the baseline and the compiled
  log-prob head with fused AdamW, `--sections learner` alone every variant (compiled decoder layers too);
- delta: encode (both hashes included) and apply+verify of the bf16 delta after one AdamW step at
  lr 1e-6, and the snapshot, at that shape;
- publish: learner steps/s at that shape with the background publisher on, its encoding in a thread
  and in a process of its own, against off (the training thread only casts the weights where they
  are; copying to the host, encoding and hashing run beside the next step);
- verification_gap: the honest gap (swarm.verification.completion_gaps) between bf16 and fp16
  samplers' log-probs and the learner's float32 recompute, over >= 1,000 completions of 256 tokens;
- vllm_sampler: the vLLM backend at that shape: tokens/s, an in-place update with its exactness
  check, and its gap to the learner after the update (skipped without CUDA or vllm).

`--small` runs the same code at a tiny size on CPU (tests/benchmarks/test_gpu_check.py). Results go to
--out (benchmarks/results) as gpu_check.json and .md (gpu_check_small.* with --small).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks.common import RESULTS, markdown_table, write_result
from benchmarks.gpu_sections import SECTION_FUNCTIONS
from benchmarks.gpu_setup import FULL, LEARNER_ONLY, SECTIONS, SMALL, Run, Size


def run_section_here(run: Run, result: Path) -> int:
    """A section in this process (the child's side): its figures, or its error, into `result`."""
    started = time.time()
    run.keep_partial = lambda figures: result.write_text(json.dumps({**figures, "partial": True}, default=str))
    try:
        figures = SECTION_FUNCTIONS[run.section](run)
    except Exception as exc:  # noqa: BLE001  recorded: the other sections still run
        traceback.print_exc()
        figures = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    figures["section_s"] = time.time() - started
    result.write_text(json.dumps(figures, default=str))
    return 0


def run_isolated(name: str, args: argparse.Namespace, size: Size, t0: float, end: float) -> dict:
    """A section in a fresh process, killed (with what it started) past its budget plus a grace, or
    10 s past the whole check's end."""
    budget = min(size.budgets[name], end - time.time())
    if budget < 10:
        return {"skipped": f"no time left of the whole check's {size.total_s:.0f} s"}
    result = Path(tempfile.mkstemp(prefix=f"gpu_check_{name}_", suffix=".json")[1])
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--device", args.device, "--dtype", args.dtype,
           "--sections", args.sections, "--child", name, str(result), str(t0), str(time.time() + budget)]
    cmd += ["--small"] if args.small else []
    started = time.time()
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        proc.wait(timeout=min(budget + 30, end + 10 - started))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        partial = result.read_text() if result.exists() else ""  # what the section kept of its figures (Run.keep_partial)
        result.unlink(missing_ok=True)
        return {**(json.loads(partial) if partial else {}),
                "error": f"killed after {time.time() - started:.0f} s (budget {budget:.0f} s, and a grace)",
                "section_s": time.time() - started}
    text = result.read_text() if result.exists() else ""
    result.unlink(missing_ok=True)
    if not text:
        return {"error": f"the section's process exited with {proc.returncode} and wrote nothing (see its output above)",
                "section_s": time.time() - started}
    return json.loads(text)


def status(result: dict) -> str:
    return "error" if "error" in result else ("skipped" if "skipped" in result else "ok")


def headline(name: str, r: dict) -> str:
    try:
        return _headline(name, r)
    except (KeyError, TypeError, ValueError) as exc:  # a figure missing: the JSON has what there is
        return f"(no headline: {type(exc).__name__} {exc})"


def _headline(name: str, r: dict) -> str:
    if status(r) != "ok":
        return (r.get("error") or r.get("skipped", "")).splitlines()[0][:120]
    if name == "demo":
        before, after = r.get("before", {}).get("pass_at_1", math.nan), r.get("after", {}).get("pass_at_1", math.nan)
        return f"{r['learner_steps']} learner steps on {r['peers_device']}; pass@1 {before:.2f} -> {after:.2f}"
    if name == "sampler":
        above = r["peak_bytes_above_weights"]
        return f"{r['tokens_per_s']:.0f} tokens/s; peak above weights {above / 2**20:.0f} MiB" if above is not None \
            else f"{r['tokens_per_s']:.0f} tokens/s"
    if name == "learner":
        done = [c for c in r["configs"] + r.get("variants", []) if "tokens_per_s" in c]
        best = max(done, key=lambda c: c["tokens_per_s"]) if done else None
        share = f", {best['model_flops_share']:.0%} of peak" if best and best["model_flops_share"] else ""
        variant = f"{best['variant']}, " if best and "variant" in best else ""
        return (f"best {best['tokens_per_s']:.0f} tokens/s ({variant}micro {best['micro_batch_groups']}, checkpointing "
                f"{best['gradient_checkpointing']}{share})" if best else "no configuration ran")
    if name == "delta":
        return (f"delta {r['delta_bytes'] / 2**20:.1f} MiB ({r['delta_fraction']:.2%} of the snapshot); encode "
                f"{r['encode_s']:.2f} s, apply+verify {r['apply_verify_s']:.2f} s")
    if name == "publish":
        return (f"steps/s publishing from a thread {r['thread_over_off']:.3f}x off, from a process "
                f"{r['process_over_off']:.3f}x (goal {r['goal']}); published {r['published']}, skipped {r['versions_skipped']}")
    if name == "verification_gap":
        return "; ".join(f"{d}: {v['completions']} completions, max {v['gap_max']:.3g}, p99.9 {v['gap_p999']:.3g}"
                         for d, v in r["by_sampler_dtype"].items())
    return f"{r['tokens_per_s']:.0f} tokens/s; update {r['update_s']:.2f} s, gap after it {r['gap_max_to_new_weights']:.3g}"


def markdown(figures: dict) -> str:
    sections = figures["sections"]
    lines = [f"# GPU check ({figures['size']})\n", f"Device: {figures['device']} ({figures['gpu'] or 'no GPU'}), dtype "
             f"{figures['dtype']}; {figures['seconds']:.0f} s in all. `python -m benchmarks.gpu_check"
             f"{' --small' if figures['size'] == 'small' else ''}`.\n",
             markdown_table(["section", "status", "seconds", "figures"],
                            [[n, status(r), f"{r.get('section_s', 0):.0f}", headline(n, r)] for n, r in sections.items()])]
    learner_result = sections.get("learner", {})
    if learner_result.get("configs"):
        lines += ["\n## Learner\n", f"{learner_result['parameters']:,} parameters; {learner_result['groups_per_step']} groups of "
                  f"{learner_result['completions_per_group']} x ({learner_result['prompt_tokens']} + "
                  f"{learner_result['completion_tokens']}) tokens a step; FLOPs share: 6 x parameters x tokens (model), 8 x "
                  "with checkpointing (hardware), over the GPU's dense bf16 peak.\n",
                  markdown_table(["micro-batch groups", "checkpointing", "tokens/s", "peak MiB", "step MiB above state",
                                  "model FLOPs share", "hardware FLOPs share"],
                                 [[c["micro_batch_groups"], c["gradient_checkpointing"],
                                   *([f"{c['tokens_per_s']:.0f}", mib(c["peak_bytes"]),
                                      mib(c["step_bytes_above_state"]), share(c["model_flops_share"]),
                                      share(c["hardware_flops_share"])] if "tokens_per_s" in c
                                     else [c.get("skipped") or "out of memory", "", "", "", ""])]
                                  for c in learner_result["configs"]])]
    if learner_result.get("variants"):
        lines += variant_tables(learner_result["variants"])
    gap = sections.get("verification_gap", {})
    if gap.get("by_sampler_dtype"):
        lines += ["\n## Honest verification gap (per-completion mean |q - p|, learner in float32)\n",
                  markdown_table(["sampler", "completions", "max", "p99.9", "p99", "p50", "per-token max"],
                                 [[d, v["completions"], v["gap_max"], v["gap_p999"], v["gap_p99"], v["gap_p50"],
                                   v["token_gap_max"]] for d, v in gap["by_sampler_dtype"].items()])]
    lines += ["\n## How\n", HOW]
    lines += ["\n## Every figure\n", "```json\n" + json.dumps(sections, indent=1, default=str)[:20000] + "\n```\n"]
    return "\n".join(lines)


HOW = """- Model: Qwen3's architecture with random (seeded) weights, at Qwen3-0.6B's shape (28 layers, hidden 1024, MLP
  3072, 16 query / 8 key-value heads of 128, vocabulary 151,936, tied embeddings; `--small`: 2 layers, hidden 64,
  vocabulary 512). A random policy's distribution is near uniform, not a trained model's: speeds and memory are the
  shape's, the verification gap is a random policy's.
- Sampler: `TransformersBackend.sample` on random prompts (static KV cache and compiled step on CUDA, after a
  warm-up call of the same shape that compiles it); memory: the allocator's peak minus the weights.
- Learner: `LearnerCore.step` on synthetic groups (random tokens, full length), float32 master weights and AdamW
  under bf16 autocast, log-probs in chunks of 2,048 tokens; one warm-up step, then one measured. FLOPs share:
  6 x parameters x tokens (8 x with checkpointing: the forward runs twice) over the GPU's dense bf16 peak; attention's
  own FLOPs (about a fifth more at 1,152 tokens) are not counted, so the share is a lower bound. Variants: each
  speed option (TrainingSettings.optimizer_implementation, torch_compile) on top of the one before, with a step timed
  by phase (CUDA events at LearnerCore's phase marks) and one profiled (torch.profiler: the head's device time,
  kernels by kind, launches, syncs); benchmarks/learner_breakdown.py.
- Delta: `encode_delta` (hashes both versions), `apply_payload_verified` (hashes base and result) and
  `encode_snapshot` of the bf16 versions before and after one step at lr 1e-6, on the host.
- Publish: `LearnerCore.step` (all groups in one micro-batch, checkpointing on) with `Publisher` and the learner's
  `VersionStore` (one whole state, undo deltas); modes alternate in blocks, median step times compared.
- Verification gap: the same weights on the bf16 grid, sampled by bf16 and fp16 copies (dynamic KV cache, eager) and
  recomputed by the float32 learner (`completion_logprobs`); per completion, the mean |q - p| over its tokens
  (`swarm.verification.completion_gaps`, what the learner's check compares with its tolerance).
- vLLM: the policy saved with a word-level tokenizer of the whole vocabulary, an engine at 35% of the GPU, an
  in-place update of every weight checked by `VLLMBackend.load_state_dict(previous=...)`, then its log-probs against
  the learner's under the new weights and under the old.
"""


def variant_tables(variants: list[dict]) -> list[str]:
    """The learner's variants (benchmarks/gpu_setup.py: LEARNER_VARIANTS): speed and share, then where each
    step's time went (benchmarks/learner_breakdown.py), then each one's top kernels."""
    def seconds(value) -> str:
        return "-" if value is None else f"{value:.3f}"

    speed, phases, tops = [], [], []
    for v in variants:
        label = [v["variant"], v["micro_batch_groups"], v["gradient_checkpointing"]]
        if "tokens_per_s" not in v:
            why = v.get("skipped") or v.get("error") or "out of memory"
            speed.append(label + [why[:200].replace("|", "/").replace("\n", " ")] + [""] * 5)
            continue
        speed.append(label + [f"{v['tokens_per_s']:.0f}", f"{v['first_step_s']:.1f}", mib(v["peak_bytes"]),
                              share(v["model_flops_share"]), share(v.get("model_flops_share_with_attention"))])
        b = v.get("breakdown")
        if not b:
            continue
        prof, ranges = b["profile"], b["profile"]["ranges"]
        kinds = prof.get("kernel_kinds_s", {})
        phases.append(label + [seconds(b["step_s"])] + [seconds(b["phases_s"].get(p)) for p in ("forward", "loss", "backward",
                                                                                                "clip", "optimizer")]
                      + [seconds(ranges.get(r, {}).get("device_s")) for r in ("logprobs/head_forward", "logprobs/head_backward")]
                      + [", ".join(f"{k} {t:.3f}" for k, t in sorted(kinds.items(), key=lambda kv: -kv[1])),
                         prof.get("kernel_launches", "-"), prof.get("host_syncs", "-"), prof["item_reads"], prof["casts"]])
        title = f"{v['variant']}, micro-batch {v['micro_batch_groups']}, checkpointing {v['gradient_checkpointing']}"
        tops.append(f"\n### {title}\n\n"
                    + markdown_table(["kernel" if "kernel" in (prof["top"] or [{}])[0] else "op", "kind", "calls", "seconds"],
                                     [[t.get("kernel", t.get("op", "")).replace("|", "/"), t.get("kind", ""), t["calls"],
                                       t.get("device_s", t.get("host_s"))] for t in prof["top"]]))
    return ["\n## Learner variants\n", "Each speed option on top of the one before (benchmarks/gpu_setup.py: "
            "LEARNER_VARIANTS); first step: AdamW's state and any compiling. With attention: PaLM's 6N + 12 x layers x heads x head_dim x "
            "sequence per token.\n",
            markdown_table(["variant", "micro-batch groups", "checkpointing", "tokens/s", "first step s", "peak MiB",
                            "model FLOPs share", "with attention"], speed),
            "\n### Where a step's time goes (seconds; phases on the device's clock, ranges and kernels from a profiled step)\n",
            markdown_table(["variant", "micro", "ckpt", "step", "forward", "loss", "backward", "clip+read-back", "optimizer",
                            "head fwd (device)", "head bwd (device)", "kernels by kind", "launches", "syncs",
                            "reads to host", "casts"], phases), *tops]


def mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def parse(argv: list[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="a tiny model and a few tokens (a CPU test)")
    parser.add_argument("--device", default="cuda" if cuda else "cpu", help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        help="samplers' dtype and the learner's autocast (default: bfloat16 on CUDA, float32 on a CPU)")
    parser.add_argument("--out", default=str(RESULTS), help="where the JSON and Markdown go")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"a comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--child", nargs=4, metavar=("SECTION", "RESULT", "T0", "DEADLINE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    size = SMALL if args.small else LEARNER_ONLY if args.sections == "learner" else FULL
    if args.child:
        name, result, t0, deadline = args.child
        if args.small:  # tiny tensors gain nothing from threads; two on two busy cores made learner steps 8x slower
            torch.set_num_threads(1)
        return run_section_here(Run(size, args.device, args.dtype, float(t0), float(deadline), section=name), Path(result))
    t0 = time.time()
    sections = {}
    for name in [s for s in SECTIONS if s in args.sections.split(",")]:
        print(f"[gpu_check {time.time() - t0:6.1f}s] {name} (budget {size.budgets[name]:.0f} s) ...", flush=True)
        sections[name] = run_isolated(name, args, size, t0, t0 + size.total_s)
        print(f"[gpu_check {time.time() - t0:6.1f}s] {name}: {status(sections[name])}: {headline(name, sections[name])}",
              flush=True)
    figures = {"size": size.label, "device": args.device, "dtype": args.dtype,
               "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") and torch.cuda.is_available() else None,
               "model": size.model, "budgets_s": size.budgets, "seconds": time.time() - t0, "sections": sections}
    text = markdown(figures)
    path = write_result("gpu_check_small" if args.small else "gpu_check", figures, text, out=Path(args.out))
    print("\n" + text.split("\n## ", 1)[0] + f"\nwritten: {path} and {path.with_suffix('.md')}", flush=True)
    return 1 if any(status(r) == "error" for r in sections.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
