"""The embedded default policy: a tiny Qwen3-architecture causal LM, warm-started on the built-in
arithmetic task so that RL has signal from the first step.

Shipped with the package (`swarm/model/embedded_policy/`, about 3 MB of safetensors) because the
warm start takes about three minutes on two CPU cores; `python -m swarm.model.embedded` rebuilds
that directory from RECIPE. The build is deterministic (same recipe, same machine type: same
weights). If RECIPE changes and the shipped copy was not rebuilt, the policy is built on first use
into the user's cache directory instead (with a progress bar), under a name that carries the
recipe's hash, so a stale build is never used. Either way it loads with `AutoModelForCausalLM` /
`AutoTokenizer` like any other model directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path

from swarm.model.tokenizer import build_tokenizer
from swarm.paths import models_cache
from swarm.tasks.synthetic import ArithmeticTask

SHIPPED_DIR = Path(__file__).resolve().parent / "embedded_policy"
RECIPE_FILE = "gepo_swarm_recipe.json"

RECIPE = {
    "version": 1,
    "architecture": {
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    # The warm start, in two supervised phases on the arithmetic task's train split:
    # 1. "learn": clean targets, long enough that the policy computes most sums right;
    # 2. "spread": a short pass in which a fraction of the targets carry a nearby wrong answer
    #    (gold +- 1..max_offset), which flattens the answer distribution without erasing the
    #    arithmetic: the most likely answer stays mostly right while a sample at temperature 1
    #    often is not. That is where RL post-training of real base models starts (better at
    #    pass@k and greedy than at pass@1), and sharpening it back is signal RL can exploit
    #    within minutes on a CPU.
    "warm_start": {
        "task_difficulty": 2, "batch_size": 64, "seed": 0,
        "phases": [
            {"name": "learn", "steps": 1200, "lr": 3e-3, "answer_noise_prob": 0.0, "answer_noise_max_offset": 0},
            {"name": "spread", "steps": 150, "lr": 1e-3, "answer_noise_prob": 0.6, "answer_noise_max_offset": 3},
        ],
    },
}


def recipe_hash() -> str:
    return hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:12]


def shipped_recipe_hash() -> str | None:
    try:
        return json.loads((SHIPPED_DIR / RECIPE_FILE).read_text())["recipe_hash"]
    except (OSError, ValueError, KeyError):
        return None


def embedded_model_dir(*, progress: bool = True) -> Path:
    """The embedded policy's directory: the shipped copy when it matches RECIPE, else a cached
    build (made first if needed; safe when several processes ask at once)."""
    if shipped_recipe_hash() == recipe_hash() and (SHIPPED_DIR / "model.safetensors").exists():
        return SHIPPED_DIR
    target = models_cache() / f"tiny-qwen3-{recipe_hash()}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits, then finds the finished build
        if not (target / "config.json").exists():
            tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
            try:
                build_embedded_model(tmp, progress=progress)
                tmp.rename(target)  # atomic: a half-built model is never visible under `target`
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def new_tiny_qwen3(vocab_size: int, pad_token_id: int, eos_token_id: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size, pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=eos_token_id,
        **RECIPE["architecture"],
    )
    return Qwen3ForCausalLM(config)


def build_embedded_model(out_dir: Path, *, progress: bool = True) -> None:
    import torch
    from rich.progress import Progress

    ws = RECIPE["warm_start"]
    torch.manual_seed(ws["seed"])
    tokenizer = build_tokenizer()
    model = new_tiny_qwen3(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    problems = ArithmeticTask(ws["task_difficulty"]).problems("train")
    prompts = [tokenizer(p.prompt)["input_ids"] for p in problems]

    def target(answer: int) -> list[int]:
        return tokenizer(f"\\boxed{{{answer}}}")["input_ids"] + [tokenizer.eos_token_id]

    answers = [int(p.answer) for p in problems]

    gen = torch.Generator().manual_seed(ws["seed"])
    model.train()
    started = time.time()
    total = sum(phase["steps"] for phase in ws["phases"])
    with Progress(disable=not progress, transient=True) as bar:
        job = bar.add_task("building the embedded policy", total=total)
        for phase in ws["phases"]:
            optimizer = torch.optim.AdamW(model.parameters(), lr=phase["lr"], weight_decay=0.0)
            steps = phase["steps"]
            schedule = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda s, steps=steps: min(1.0, (s + 1) / 30) * max(0.05, 1 - s / steps)
            )
            for _ in range(steps):
                idx = torch.randint(len(problems), (ws["batch_size"],), generator=gen).tolist()
                noisy = (torch.rand(len(idx), generator=gen) < phase["answer_noise_prob"]).tolist()
                offsets = torch.randint(1, max(1, phase["answer_noise_max_offset"]) + 1, (len(idx),), generator=gen)
                signs = torch.randint(0, 2, (len(idx),), generator=gen) * 2 - 1
                shifted = [answers[i] + (int(o * sg) if n else 0) for i, n, o, sg in zip(idx, noisy, offsets, signs)]
                input_ids, labels = _sft_batch([prompts[i] for i in idx], [target(a) for a in shifted], tokenizer.pad_token_id)
                attention = (labels != -100) | (input_ids != tokenizer.pad_token_id)
                loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
                bar.advance(job)
    model.eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / RECIPE_FILE).write_text(
        json.dumps({"recipe": RECIPE, "recipe_hash": recipe_hash(), "build_seconds": round(time.time() - started, 1)}, indent=2)
    )


def _sft_batch(prompts: list[list[int]], targets: list[list[int]], pad_id: int):
    """Right-padded prompt+target rows; loss only on target tokens."""
    import torch

    rows = [p + t for p, t in zip(prompts, targets)]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (p, t) in enumerate(zip(prompts, targets)):
        input_ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p) : len(p) + len(t)] = torch.tensor(t)
    return input_ids, labels


if __name__ == "__main__":
    # Rebuild the shipped copy: python -m swarm.model.embedded
    import torch

    torch.set_num_threads(2)  # the thread count is part of what makes the build reproducible
    staging = Path(tempfile.mkdtemp(prefix="embedded_policy-"))
    build_embedded_model(staging, progress=True)
    shutil.rmtree(SHIPPED_DIR, ignore_errors=True)
    shutil.copytree(staging, SHIPPED_DIR)
    shutil.rmtree(staging, ignore_errors=True)
    print(f"rebuilt {SHIPPED_DIR} (recipe {recipe_hash()})")
