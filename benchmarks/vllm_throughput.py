"""The sampler's vLLM path against plain `vllm.LLM.generate` on the same prompts: completion tokens
per second of `VLLMBackend.generate` (processed log-probs recorded, results turned into
Generations) over the engine's own generate without log-probs. Goal: at least 0.95.

Both paths run on the same engine (started with logprobs_mode="processed_logprobs"), so the figure
is the cost of asking for the sampled token's log-prob (logprobs=0) and of building Generations.
The vLLM calls were checked against vLLM 0.10.x, 0.11.x and 0.33.0 sources (see
swarm/generation/vllm_backend.py). Needs a CUDA device and the `vllm` extra; elsewhere it records
why it did not run. It has never run in this project's work so far (no GPU machine was lent).

`python -m benchmarks vllm_throughput`
"""

from __future__ import annotations

import time

from benchmarks.common import write_result

PROMPTS, G, MAX_TOKENS = 64, 8, 128


def skipped(reason: str) -> dict:
    figures = {"skipped": reason}
    write_result("vllm_throughput", figures, f"# vLLM sampler throughput\n\nNot run: {reason}.\n\n{__doc__.strip()}\n")
    return figures


def run() -> dict:
    import torch

    if not torch.cuda.is_available():
        return skipped("no CUDA device on this machine")
    try:
        import vllm  # noqa: F401
    except ImportError:
        return skipped("the vllm extra is not installed (pip install -e '.[vllm]')")
    from vllm import SamplingParams as VSamplingParams

    from swarm.generation import SamplingParams, make_backend
    from swarm.model.loading import resolve_model_dir
    from swarm.tasks.synthetic import ArithmeticTask

    backend = make_backend("vllm", resolve_model_dir("embedded"), dtype="bfloat16", gpu_memory_utilization=0.5)
    prompts = [p.prompt for p in ArithmeticTask(2).problems("train")[:PROMPTS]]
    ours = SamplingParams(num_completions=G, max_new_tokens=MAX_TOKENS, temperature=1.0, seed=0)
    plain = VSamplingParams(n=G, max_tokens=MAX_TOKENS, temperature=1.0, seed=0)
    backend.generate(prompts[:4], ours)  # warm-up of both paths: CUDA graphs, caches
    backend.llm.generate(prompts[:4], plain, use_tqdm=False)
    rates = {"sampler": [], "plain": []}
    for _ in range(3):  # interleaved, best of three
        started = time.perf_counter()
        tokens = sum(g.num_tokens() for g in backend.generate(prompts, ours))
        rates["sampler"].append(tokens / (time.perf_counter() - started))
        started = time.perf_counter()
        outputs = backend.llm.generate(prompts, plain, use_tqdm=False)
        tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        rates["plain"].append(tokens / (time.perf_counter() - started))
    figures = {"sampler_tokens_per_s": max(rates["sampler"]), "plain_tokens_per_s": max(rates["plain"]),
               "ratio": max(rates["sampler"]) / max(rates["plain"]), "device": torch.cuda.get_device_name()}
    write_result("vllm_throughput", figures,
                 f"# vLLM sampler throughput\n\n{__doc__.strip()}\n\n{figures['device']}: the sampler's path "
                 f"{figures['sampler_tokens_per_s']:.0f} tokens/s, plain generate {figures['plain_tokens_per_s']:.0f} "
                 f"tokens/s, ratio {figures['ratio']:.3f} (goal >= 0.95).\n")
    return figures
