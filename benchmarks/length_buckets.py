"""The learner's decoder on length buckets against one padded run, on a batch whose completions are
mostly short with a few long ones ("Real-scale peers": no 30-token completion padded to 1,024).

Model: a Qwen3 whose decoder outweighs its output layer, as Qwen3-0.6B's does (there 440 M multiply-adds
per token in the decoder against 156 M in the head): hidden 512, 8 layers, 8 heads of 64, 4 KV heads,
intermediate 1,536, a 32,768-token vocabulary (tied), float32, seeded random weights. Buckets change
only the decoder's work (the head runs on real completion tokens either way), so a model whose head
dominates, like learner_step.py's, would hide them. Batch: 1 group of 8 completions after a 64-token
prompt: one completion of 1,024 tokens, one of 512, the rest 30-90 (a reasoning task where most
answers are short and a few run to the limit).

Timed: `swarm.logprobs.completion_logprobs` forward and backward (chunked head), with the default
buckets and with `max_buckets=1` (one run padded to the longest row: the learner before buckets).
Alternating, warm-up 1 each, medians. The log-probs of both paths are compared too.

`python -m benchmarks length_buckets`
"""

from __future__ import annotations

import os
import random
import statistics
import time

from benchmarks.common import machine, markdown_table, write_result
VOCAB, PAD = 32_768, 0
BODY = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
            intermediate_size=1536)
GROUPS, G, PROMPT = 1, 8, 64
WARMUP, REPEATS = 1, int(os.environ.get("GEPO_LENGTH_BUCKETS_REPEATS", 3))


def make_model():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=2048, pad_token_id=PAD, **BODY)
    return Qwen3ForCausalLM(config).float()


def make_batch(seed: int = 0):
    import torch

    from swarm.rollouts import RolloutGroup, collate

    rng = random.Random(seed)
    groups = []
    for i in range(GROUPS):
        lengths = [1024, 512] + [rng.randint(30, 90) for _ in range(G - 2)]
        groups.append(RolloutGroup(problem_id=f"p{i}", prompt_ids=[rng.randrange(1, VOCAB) for _ in range(PROMPT)],
                                   completion_ids=[[rng.randrange(1, VOCAB) for _ in range(n)] for n in lengths],
                                   sampler_logprobs=[[0.0] * n for n in lengths], rewards=[0.0] * G, version=0,
                                   sampler_id="bench"))
    batch = collate(groups, PAD)
    return batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask.long(), torch


def run() -> dict:
    from swarm.config import TrainingSettings
    from swarm.logprobs import completion_logprobs, length_buckets

    model = make_model().train()
    p_ids, p_mask, c_ids, c_mask, torch = make_batch()
    chunk = TrainingSettings().logprob_chunk
    paths = {"buckets": {}, "padded": {"max_buckets": 1}}
    seconds: dict[str, list[float]] = {n: [] for n in paths}
    values = {}
    for repeat in range(WARMUP + REPEATS):
        for name, kwargs in paths.items():
            model.zero_grad(set_to_none=True)
            started = time.perf_counter()
            lp = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, chunk=chunk, **kwargs)
            lp.sum().backward()
            if repeat >= WARMUP:
                seconds[name].append(time.perf_counter() - started)
            values[name] = lp.detach()
        print(f"[length_buckets] repeat {repeat + 1}/{WARMUP + REPEATS}: "
              + ", ".join(f"{n} {s[-1]:.2f}s" for n, s in seconds.items() if s), flush=True)
    prompts, completions = p_mask.sum(1).tolist(), c_mask.sum(1).tolist()
    buckets = length_buckets(prompts, completions)
    real = sum(prompts) + sum(completions)
    padded = {"buckets": sum(len(r) * (max(prompts[i] for i in r) + max(completions[i] for i in r)) for r in buckets),
              "padded": len(prompts) * (max(prompts) + max(completions))}
    medians = {n: statistics.median(s) for n, s in seconds.items()}
    figures = {
        "machine": machine(), "busy_note": os.environ.get("GEPO_BENCH_NOTE", ""),
        "model": {"vocab": VOCAB, **BODY, "dtype": "float32"},
        "batch": {"groups": GROUPS, "completions_per_group": G, "prompt_tokens": PROMPT, "real_tokens": real,
                  "completion_lengths": completions},
        "buckets": [len(r) for r in buckets], "padded_tokens": padded,
        "seconds": seconds, "median_s": {n: round(m, 3) for n, m in medians.items()},
        "buckets_over_padded": round(medians["buckets"] / medians["padded"], 3),
        "max_abs_logprob_difference": float((values["buckets"] - values["padded"]).abs().max()),
    }
    write_result("length_buckets", figures, markdown(figures))
    return figures


def markdown(f: dict) -> str:
    rows = [[n, f["median_s"][n], f["padded_tokens"][n], round(f["batch"]["real_tokens"] / f["padded_tokens"][n], 3)]
            for n in ("buckets", "padded")]
    return (f"# Length buckets against one padded run\n\n{__doc__.strip()}\n\nMachine: {f['machine']}. {f['busy_note']}\n\n"
            + markdown_table(["path", "median s (forward + backward)", "decoder tokens", "real share"], rows)
            + f"\n- Buckets over padded: **{f['buckets_over_padded']:.3f}x** the time, with {len(f['buckets'])} decoder runs "
            f"(rows per run {f['buckets']}).\n- Largest log-prob difference between the paths: "
            f"{f['max_abs_logprob_difference']:.2e}.\n")


if __name__ == "__main__":
    import torch

    torch.set_num_threads(2)
    run()
