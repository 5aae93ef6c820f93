"""The embedded default policy: a tiny Qwen3-architecture causal LM, warm-started on the built-in
arithmetic task so that RL has signal from the first step.

Built on first use into the user's cache directory (about half a minute on two CPU cores, with a
progress bar), then loaded from there with `AutoModelForCausalLM` / `AutoTokenizer` like any other
model directory. The build is deterministic: the same recipe gives the same weights, and the
recipe's hash names the directory so a changed recipe never reuses an old build.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

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
    # The supervised warm start: few enough steps that the policy is right only part of the time
    # (sampled accuracy between 10% and 60%), which leaves RL something to improve.
    "warm_start": {"task_difficulty": 2, "steps": 300, "batch_size": 64, "lr": 3e-3, "seed": 0},
}


def recipe_hash() -> str:
    return hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:12]


def cache_root() -> Path:
    root = os.environ.get("GEPO_SWARM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "gepo-swarm"
    )
    return Path(root)


def embedded_model_dir(*, progress: bool = True) -> Path:
    """The embedded policy's directory, building it first if needed (safe across processes)."""
    target = cache_root() / "models" / f"tiny-qwen3-{recipe_hash()}"
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

    from swarm.model.tokenizer import build_tokenizer
    from swarm.tasks.synthetic import ArithmeticTask

    ws = RECIPE["warm_start"]
    torch.manual_seed(ws["seed"])
    tokenizer = build_tokenizer()
    model = new_tiny_qwen3(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    problems = ArithmeticTask(ws["task_difficulty"]).problems("train")
    prompts = [tokenizer(p.prompt)["input_ids"] for p in problems]
    targets = [tokenizer(f"\\boxed{{{p.answer}}}")["input_ids"] + [tokenizer.eos_token_id] for p in problems]

    optimizer = torch.optim.AdamW(model.parameters(), lr=ws["lr"], weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 30) * max(0.05, 1 - s / ws["steps"])
    )
    gen = torch.Generator().manual_seed(ws["seed"])
    model.train()
    started = time.time()
    with Progress(disable=not progress, transient=True) as bar:
        job = bar.add_task("building the embedded policy (first use only)", total=ws["steps"])
        for _ in range(ws["steps"]):
            idx = torch.randint(len(problems), (ws["batch_size"],), generator=gen).tolist()
            input_ids, labels = _sft_batch([prompts[i] for i in idx], [targets[i] for i in idx], tokenizer.pad_token_id)
            loss = model(input_ids=input_ids, attention_mask=(labels != -100) | (input_ids != tokenizer.pad_token_id), labels=labels).loss
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
    (out_dir / "gepo_swarm_recipe.json").write_text(
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
