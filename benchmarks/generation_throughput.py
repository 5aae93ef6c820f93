"""Sampler throughput: the transformers generation backend (which also records per-token
log-probs and splits completions at EOS) against a raw `model.generate` call on the same model,
prompts and sampling settings, in completion tokens per second; target ratio >= 0.95. Also how
many completions per second the reward scorer checks with math-verify.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import markdown_table, write_result
from swarm.generation import SamplingParams
from swarm.generation.transformers_backend import TransformersBackend
from swarm.rewards import RewardScorer, resolve_reward, score_one
from swarm.tasks.synthetic import ArithmeticTask


def raw_generate_tokens(model, tokenizer, prompts, params: SamplingParams) -> int:
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    g = params.num_completions
    out = model.generate(
        input_ids=enc["input_ids"].repeat_interleave(g, 0),
        attention_mask=enc["attention_mask"].repeat_interleave(g, 0),
        do_sample=True, temperature=params.temperature, top_k=None, top_p=1.0,
        max_new_tokens=params.max_new_tokens, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    new = out[:, enc["input_ids"].size(1):]
    eos = tokenizer.eos_token_id
    # count tokens up to and including the first EOS, as the backend does
    is_eos = (new == eos).int()
    after_eos = (is_eos.cumsum(1) - is_eos) > 0
    return int((~after_eos).sum())


def run(repeats: int = 5, model_dir: str | None = None) -> dict:
    from swarm.model.loading import load_policy

    model, tokenizer = load_policy(model_dir or "embedded")
    backend = TransformersBackend(model, tokenizer, batch_tokens=1 << 20)
    problems = ArithmeticTask(2).problems("test")[:32]
    prompts = [p.prompt for p in problems]
    params = SamplingParams(num_completions=8, max_new_tokens=24, temperature=1.0)

    raw_rates, backend_rates = [], []
    with torch.no_grad():
        for i in range(repeats + 1):
            torch.manual_seed(i)
            t0 = time.perf_counter()
            n_raw = raw_generate_tokens(model, tokenizer, prompts, params)
            t_raw = time.perf_counter() - t0
            torch.manual_seed(i)
            t0 = time.perf_counter()
            gens = backend.generate(prompts, params)
            t_backend = time.perf_counter() - t0
            if i == 0:
                continue  # warm-up
            raw_rates.append(n_raw / t_raw)
            backend_rates.append(sum(g.num_tokens() for g in gens) / t_backend)

    scorer = RewardScorer([("accuracy", 1.0)])
    completions = [t for g in gens for t in g.texts]
    answers = [p.answer for p, g in zip(problems, gens) for _ in g.texts]
    scorer.score(completions[:16], answers[:16])  # start the worker, warm math-verify's caches and imports
    rounds, group = 4, params.num_completions
    t0 = time.perf_counter()
    for _ in range(rounds):
        for start in range(0, len(completions), group):  # one group per call, as a learner scores them
            scorer.score(completions[start : start + group], answers[start : start + group])
    rewards_per_s = rounds * len(completions) / (time.perf_counter() - t0)
    scorer.close()
    # baseline: the same scoring in this process, with no worker to kill (what the scorer did before)
    fns = [(resolve_reward("accuracy"), 1.0)]
    t0 = time.perf_counter()
    for _ in range(rounds):
        for completion, answer in zip(completions, answers):
            score_one(fns, completion, answer, scorer.timeout_s)
    in_process_per_s = rounds * len(completions) / (time.perf_counter() - t0)

    figures = {
        "prompts": len(prompts), "completions_per_prompt": params.num_completions, "max_new_tokens": params.max_new_tokens,
        "raw_generate_tokens_per_s": statistics.median(raw_rates),
        "backend_tokens_per_s": statistics.median(backend_rates),
        "ratio": statistics.median(backend_rates) / statistics.median(raw_rates),
        "target_ratio_at_least": 0.95,
        "rewards_scored_per_s": rewards_per_s,
        "rewards_scored_in_process_per_s": in_process_per_s,
        "reward_worker_ratio": rewards_per_s / in_process_per_s,
        "repeats": repeats,
    }
    md = "# Sampler generation throughput\n\n" + markdown_table(
        ["what", "completion tokens / s"],
        [["raw model.generate", figures["raw_generate_tokens_per_s"]], ["transformers backend (with log-probs)", figures["backend_tokens_per_s"]]],
    ) + f"\nratio backend / raw: **{figures['ratio']:.3f}** (target >= 0.95); " \
        f"{len(prompts)} prompts x {params.num_completions} completions, median of {repeats}.\n\n" \
        f"math-verify accuracy reward: **{rewards_per_s:.0f} completions scored / s** in the scorer's killable worker, " \
        f"one group of {group} per call, against {in_process_per_s:.0f} / s in this process with no worker: " \
        f"**{rewards_per_s / in_process_per_s:.2f}x**.\n"
    write_result("generation_throughput", figures, md)
    return figures
