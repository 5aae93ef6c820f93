"""The learner's memory against micro-batch size and batch size, and its step time in float32
against bfloat16 autocast, on the mid-size model (swarm/model/midsize.py: Qwen3 architecture, a
BPE tokenizer trained here).

Each configuration runs in a fresh process: the model and AdamW are made, one warm-up step
allocates the optimizer state, then one measured step runs while a thread samples the process's
resident memory every 5 ms. "Step memory" is the peak during the measured step minus the resident
memory just before it: what the step itself needs (activations, logits, gradients), on top of the
weights and the optimizer state that every configuration holds alike. Groups are synthetic (random
tokens of the model's vocabulary, G=4 completions of 64 tokens after 32-token prompts): memory and
time depend on shapes, not on what the tokens say. CPU only here; GPU memory was not measured.

`python -m benchmarks learner_memory`
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

from benchmarks.common import markdown_table, write_result

G, PROMPT, COMPLETION = 4, 32, 64


def groups(count: int, vocab: int, seed: int = 0):
    import random

    from swarm.rollouts import RolloutGroup

    rng = random.Random(seed)
    made = []
    for i in range(count):
        completions = [[rng.randrange(3, vocab) for _ in range(COMPLETION)] for _ in range(G)]
        made.append(RolloutGroup(problem_id=f"p{i}", prompt_ids=[rng.randrange(3, vocab) for _ in range(PROMPT)],
                                 completion_ids=completions, sampler_logprobs=[[-2.0] * COMPLETION for _ in range(G)],
                                 rewards=[1.0, 0.0] * (G // 2), version=0, sampler_id="bench"))
    return made


def measure(batch: int, micro: int, dtype: str, chunk: int, checkpointing: bool) -> dict:
    """One configuration, in this process (a fresh one: see `run`)."""
    import psutil
    import torch

    from swarm.model.loading import load_policy
    from swarm.model.midsize import midsize_model_dir
    from swarm.training import LearnerCore

    torch.manual_seed(0)
    model, tokenizer = load_policy(str(midsize_model_dir()))
    core = LearnerCore(model, tokenizer.pad_token_id, micro_batch_groups=micro, logprob_chunk=chunk,
                       gradient_checkpointing=checkpointing, autocast_dtype=torch.bfloat16 if dtype == "bfloat16" else None)
    vocab = len(tokenizer)
    core.step(groups(1, vocab, seed=1))  # allocates AdamW's state
    me, peak, stop = psutil.Process(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], me.memory_info().rss)
            time.sleep(0.005)

    before = me.memory_info().rss
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    core.step(groups(batch, vocab))
    seconds = time.perf_counter() - started
    stop.set()
    sampler.join()
    return {"batch_groups": batch, "micro_batch_groups": micro, "dtype": dtype, "logprob_chunk": chunk,
            "gradient_checkpointing": checkpointing, "tokens": batch * G * (PROMPT + COMPLETION),
            "parameters": sum(p.numel() for p in model.parameters()), "vocab": vocab,
            "resident_before_mb": round(before / 2**20, 1), "step_memory_mb": round((peak[0] - before) / 2**20, 1),
            "step_seconds": round(seconds, 3)}


def in_fresh_process(**config) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.learner_memory", json.dumps(config)], capture_output=True,
                         text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"learner_memory {config} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run() -> dict:
    from swarm.model.midsize import midsize_model_dir

    midsize_model_dir()  # built once, before the timed processes
    base = {"dtype": "float32", "chunk": 2048, "checkpointing": False}
    by_micro = [in_fresh_process(batch=8, micro=m, **base) for m in (1, 2, 4, 8)]
    by_batch = [in_fresh_process(batch=b, micro=2, **base) for b in (2, 4, 8, 16)]
    by_option = [in_fresh_process(batch=8, micro=8, dtype="float32", chunk=0, checkpointing=False),
                 in_fresh_process(batch=8, micro=8, dtype="float32", chunk=2048, checkpointing=True),
                 in_fresh_process(batch=8, micro=2, dtype="bfloat16", chunk=2048, checkpointing=False)]
    fp32 = next(r for r in by_micro if r["micro_batch_groups"] == 2)
    bf16 = by_option[2]
    figures = {
        "by_micro_batch": by_micro, "by_batch": by_batch, "by_option": by_option,
        "batch_16_over_batch_4_memory": round(by_batch[-1]["step_memory_mb"] / max(by_batch[1]["step_memory_mb"], 1e-9), 3),
        "micro_8_over_micro_1_memory": round(by_micro[-1]["step_memory_mb"] / max(by_micro[0]["step_memory_mb"], 1e-9), 3),
        "checkpointing_over_none_memory": round(by_option[1]["step_memory_mb"] / by_micro[-1]["step_memory_mb"], 3),
        "bf16_over_fp32_step_time": round(bf16["step_seconds"] / fp32["step_seconds"], 3),
    }
    write_result("learner_memory", figures, markdown(figures))
    return figures


def markdown(figures: dict) -> str:
    columns = ["batch_groups", "micro_batch_groups", "dtype", "logprob_chunk", "gradient_checkpointing", "tokens",
               "step_memory_mb", "step_seconds"]
    rows = figures["by_micro_batch"] + figures["by_batch"] + figures["by_option"]
    table = markdown_table(columns, [[r[c] for c in columns] for r in rows])
    model, one = figures["by_micro_batch"][0], figures["by_batch"][0]
    return (f"# Learner memory and step time\n\n{__doc__.strip()}\n\nModel: {model['parameters']:,} parameters, "
            f"{model['vocab']:,}-token vocabulary; resident before a step about {model['resident_before_mb']:.0f} MB.\n\n"
            f"{table}\n"
            f"- Memory against batch size at 2 groups per micro-batch: flat once a batch takes several micro-batches "
            f"(16 groups: {figures['batch_16_over_batch_4_memory']:.2f}x the step memory of 4). A batch that is a single "
            f"micro-batch ({one['batch_groups']} groups) needed {one['step_memory_mb']:.0f} MB: the second micro-batch's "
            "activations do not reuse all of the memory the first one freed (resident memory, as the allocator keeps it).\n"
            f"- Memory against micro-batch size for a batch of 8 groups: 8 groups per micro-batch take "
            f"{figures['micro_8_over_micro_1_memory']:.2f}x the step memory of 1; gradient checkpointing takes it to "
            f"{figures['checkpointing_over_none_memory']:.2f}x (for about 10% more time here).\n"
            f"- Step time, bfloat16 autocast over float32 (2 groups per micro-batch): "
            f"{figures['bf16_over_fp32_step_time']:.2f}x on this CPU. On GPUs bfloat16 is the fast path (not measured here).\n"
            "- Chunked log-probs barely matter at this model's 2,656-token vocabulary; at Qwen3's 151,936 the float32 "
            "(batch, length, vocab) logits of one micro-batch of 16 groups x 8 completions x 1,024 tokens would be 80 GB, "
            "chunks of 2,048 tokens keep them at 1.2 GB.\n")


if __name__ == "__main__":
    import torch

    torch.set_num_threads(2)
    print(json.dumps(measure(**json.loads(sys.argv[1]))))
