"""Generation memory and speed of the transformers backend's log-prob recording, on CPU.

Model: Qwen3 architecture with random (seeded) weights, 2 layers, hidden 256, and Qwen3-0.6B's
real vocabulary (151,936 tokens, tied embeddings): the vocabulary is what the old recording's
memory grew with. 8 rows (1 prompt of 32 random token ids x 8 completions), no tokenizer.

1. Peak memory above the model, at 64 and 256 new tokens, for
   - new: `TransformersBackend.sample` (SampledLogprobs keeps the sampled token's log-prob a step);
   - old: the recording as it was at commit 53166a4, reproduced below as `old_sample` (BASELINE):
     `generate(output_scores=True)`, stack the scores, float32 log_softmax, gather.
   Each case runs in a fresh process: model built, a 2-token warm-up of the same path (so allocator
   warm-up counts as the model's), resident memory read, the peak reset, then the measured run.
   Peak = VmHWM after the run minus VmRSS before it. Not ru_maxrss: Linux carries a parent's peak
   into a vfork+exec'd child's ru_maxrss and it cannot be reset; VmHWM can (/proc/self/clear_refs).
   Goal: new peak at 256 / peak at 64 <= 1.5.
2. Completion tokens/s of `TransformersBackend.sample` against plain `model.generate` without scores,
   same model, rows, length (64 new tokens) and sampling (temperature 1.0 and 0.7/top-p 0.9; top-k off), repeats
   interleaved, median. Goal: new / plain >= 0.9. EOS is an id the random model practically never
   samples, and each run is checked to have run exactly the requested number of steps.

`python -m benchmarks generation_memory`
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import torch

from benchmarks.common import machine, markdown_table, write_result

VOCAB, HIDDEN, LAYERS, PROMPT, ROWS, SEED = 151_936, 256, 2, 32, 8, 0
EOS, PAD = VOCAB - 1, 0
MEMORY_TOKENS = (64, 256)
GROWTH_GOAL, SPEED_GOAL = 1.5, 0.9
SETTINGS = {"temperature 1.0": (1.0, 1.0), "temperature 0.7, top-p 0.9": (0.7, 0.9)}


def build() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(SEED)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=HIDDEN // 4, tie_word_embeddings=True,
                         bos_token_id=PAD, eos_token_id=EOS, pad_token_id=PAD)
    model = Qwen3ForCausalLM(config).eval()
    prompt = torch.randint(1, EOS, (1, PROMPT)).repeat(ROWS, 1)  # 1 prompt x 8 completions
    return model, prompt, torch.ones_like(prompt)


def backend(model):
    from swarm.generation.transformers_backend import TransformersBackend

    # sample() reads only pad/eos ids from the tokenizer; the constructor sets padding_side
    return TransformersBackend(model, SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS, padding_side="left"))


def new_sample(model, ids, mask, tokens: int, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    from swarm.generation import SamplingParams

    params = SamplingParams(num_completions=ROWS, max_new_tokens=tokens, temperature=temperature, top_p=top_p)
    return backend(model).sample(ids, mask, params)[1]


@torch.no_grad()
def old_sample(model, ids, mask, tokens: int, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """BASELINE, not the project's code: the recording before the change (53166a4's _generate_batch)."""
    result = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, do_sample=True,
                            temperature=temperature, top_p=top_p, top_k=None, pad_token_id=PAD, eos_token_id=EOS,
                            return_dict_in_generate=True, output_scores=True)
    new_tokens = result.sequences[:, ids.size(1):]
    scores = torch.stack(result.scores, dim=1).float()  # (rows, steps, V) processed logits
    return torch.log_softmax(scores, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def plain_generate(model, ids, mask, tokens: int, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """The reference for speed: generate with the same sampling, recording nothing."""
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, do_sample=True,
                         temperature=temperature, top_p=top_p, top_k=0, pad_token_id=PAD, eos_token_id=EOS)
    return out[:, ids.size(1):]


PATHS = {"new": new_sample, "old": old_sample}


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measure_case(case: str, tokens: int) -> dict:
    """One memory case, in this (fresh) process."""
    model, ids, mask = build()
    PATHS[case](model, ids, mask, 2)  # warm-up: its allocations count as the model's
    before_kib = status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current resident memory
    out = PATHS[case](model, ids, mask, tokens)
    assert out.shape == (ROWS, tokens), out.shape  # every row ran the whole length
    return {"case": case, "new_tokens": tokens, "model_rss_mb": before_kib / 1024,
            "peak_mb_above_model": (status_kib("VmHWM") - before_kib) / 1024}


def run_case(case: str, tokens: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.generation_memory", "--case", case, "--new-tokens", str(tokens),
           "--threads", str(torch.get_num_threads())]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def speed(model, ids, mask, tokens: int, repeats: int) -> dict:
    """Tokens/s, new path against plain generate, alternating so that drift hits both alike."""
    out = {}
    for label, (temperature, top_p) in SETTINGS.items():
        rates: dict[str, list[float]] = {"plain": [], "new": []}
        for i in range(repeats + 1):  # the first round warms up
            for name, fn in (("plain", plain_generate), ("new", new_sample)):
                torch.manual_seed(SEED + i)
                t0 = time.perf_counter()
                result = fn(model, ids, mask, tokens, temperature, top_p)
                elapsed = time.perf_counter() - t0
                assert result.shape == (ROWS, tokens), result.shape
                if i:
                    rates[name].append(ROWS * tokens / elapsed)
        plain, new = statistics.median(rates["plain"]), statistics.median(rates["new"])
        out[label] = {"plain_tokens_per_s": plain, "new_tokens_per_s": new, "ratio": new / plain, "rates": rates}
    return out


def met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def run(repeats: int = 5, speed_tokens: int = 64) -> dict:
    load_before = os.getloadavg()[0]  # other work on the machine skews tokens/s: shown with the figures
    memory = [run_case(case, n) for case in PATHS for n in MEMORY_TOKENS]
    peak = {(m["case"], m["new_tokens"]): m["peak_mb_above_model"] for m in memory}
    growth = {case: peak[case, MEMORY_TOKENS[1]] / peak[case, MEMORY_TOKENS[0]] for case in PATHS}
    model, ids, mask = build()
    rates = speed(model, ids, mask, speed_tokens, repeats)
    figures = {
        "model": {"vocab": VOCAB, "hidden": HIDDEN, "layers": LAYERS, "tied_embeddings": True, "dtype": "float32"},
        "rows": ROWS, "prompt_tokens": PROMPT, "memory": memory,
        "growth_256_over_64": growth, "growth_goal_at_most": GROWTH_GOAL,
        "speed_new_tokens": speed_tokens, "repeats": repeats, "speed": rates, "speed_goal_at_least": SPEED_GOAL,
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
    }
    labels = {"new": "new: TransformersBackend.sample", "old": "old (baseline, pre-change code)"}
    md = "# Generation memory: log-prob recording\n\n" + markdown_table(
        ["case", "new tokens", "peak MB above model"],
        [[labels[m["case"]], m["new_tokens"], m["peak_mb_above_model"]] for m in memory],
    ) + "\n" + markdown_table(
        ["case", "peak at 256 / peak at 64", f"goal <= {GROWTH_GOAL} (new path)"],
        [[labels[c], growth[c], met(growth[c] <= GROWTH_GOAL) if c == "new" else "-"] for c in PATHS],
    ) + f"\n## Speed: completion tokens/s, {ROWS} rows x {speed_tokens} new tokens, median of {repeats}\n\n" + markdown_table(
        ["sampling", "plain generate", "new path", "new / plain", f"goal >= {SPEED_GOAL}"],
        [[k, v["plain_tokens_per_s"], v["new_tokens_per_s"], v["ratio"], met(v["ratio"] >= SPEED_GOAL)]
         for k, v in rates.items()],
    ) + (f"\nModel: Qwen3 architecture, random weights (seed {SEED}), {LAYERS} layers, hidden {HIDDEN}, vocabulary {VOCAB:,} "
         f"(tied embeddings), float32; {ROWS} rows = 1 prompt of {PROMPT} tokens x {ROWS}. Memory: fresh process per case, "
         "VmHWM after the run minus VmRSS after a 2-token warm-up. The model's own compute is tiny here, so the "
         "recording's per-step cost weighs more than it would on Qwen3-0.6B. 1-minute load average "
         f"{load_before:.2f} before, {figures['load_average_1min']['after']:.2f} after.\n\n"
         f"Machine: {json.dumps(machine())}\n")
    write_result("generation_memory", figures, md)
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one memory case, in this process (run() starts these)")
    parser.add_argument("--case", choices=list(PATHS), required=True)
    parser.add_argument("--new-tokens", type=int, required=True)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(json.dumps(measure_case(args.case, args.new_tokens)))
