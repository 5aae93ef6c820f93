"""A learner step against a bare Hugging Face forward and backward of the same tokens, on a small model
with Qwen3's vocabulary ("Real-scale peers": within 1.15x on this CPU).

Model: transformers' Qwen3ForCausalLM with Qwen3-0.6B's 151,936-token vocabulary and tied embeddings, a
small body (hidden 256, 4 layers, 4 heads, 2 KV heads, head_dim 64, intermediate 768), seeded random
weights, float32. Batch: 4 rollout groups x 8 completions after 64-token prompts, completion lengths
uniform in 64..320 cut at 256 (those cut short carry no EOS, the others end with it), sampler log-probs
the model's own plus noise (std 0.01), rewards 0/1 with both in every group, version 0.

Learner: swarm.training.LearnerCore.from_settings with TrainingSettings' defaults (TOPR, AdamW, gradient
clipping, micro_batch_groups, logprob_chunk, no gradient checkpointing), `step(groups)`. Bare: the same
prompt+completion tokens, one right-padded batch per group (gradient accumulation over the 4 groups:
all 32 rows in one padded batch make 6 GB per float32 copy of the logits, and the loss holds several),
`model(input_ids, attention_mask, labels, num_items_in_batch)` with labels -100 on prompt and padding, `.loss.backward()`,
then the same gradient clipping and AdamW step: the optimizer step is timed in both. Each path has
its own copy of the weights; steps alternate (warm-up 2 each), medians. A profiled step of each
(torch.profiler, CPU ops by self time, by input shape) shows where the time goes.

`python -m benchmarks learner_step`
"""

from __future__ import annotations

import copy
import os
import random
import statistics
import time

from benchmarks.common import machine, markdown_table, write_result

VOCAB, PAD, EOS = 151_936, 151_643, 151_645  # Qwen3's vocabulary size, <|endoftext|>, <|im_end|>
BODY = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            intermediate_size=768)
GROUPS, G, PROMPT, SHORTEST, LONGEST = 4, 8, 64, 64, 256
# GEPO_LEARNER_STEP_REPEATS=N for a quicker run (the figures in results/ were taken with the defaults)
WARMUP, REPEATS = 2, int(os.environ.get("GEPO_LEARNER_STEP_REPEATS", 7))


def make_model():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=2048, bos_token_id=PAD,
                         eos_token_id=EOS, pad_token_id=PAD, **BODY)
    return Qwen3ForCausalLM(config).float()


def make_groups(model, seed: int = 0):
    import torch

    from swarm.logprobs import completion_logprobs
    from swarm.rollouts import RolloutGroup, collate

    rng = random.Random(seed)
    torch.manual_seed(seed)
    groups = []
    for i in range(GROUPS):
        completions = []
        for _ in range(G):
            n = min(rng.randint(SHORTEST, LONGEST + 64), LONGEST)
            completions.append([rng.randrange(PAD) for _ in range(n - 1)] + [EOS if n < LONGEST else rng.randrange(PAD)])
        right = rng.randint(1, G - 1)
        rewards = [1.0] * right + [0.0] * (G - right)
        rng.shuffle(rewards)
        groups.append(RolloutGroup(problem_id=f"p{i}", prompt_ids=[rng.randrange(PAD) for _ in range(PROMPT)],
                                   completion_ids=completions, sampler_logprobs=[], rewards=rewards, version=0,
                                   sampler_id="bench"))
    model.eval()
    with torch.no_grad():
        for g in groups:
            b = collate([g], PAD)
            lp = completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask, chunk=2048)
            lp = lp + 0.01 * torch.randn_like(lp)
            g.sampler_logprobs = [lp[j, : len(c)].tolist() for j, c in enumerate(g.completion_ids)]
    return groups


class Bare:
    """The Hugging Face path: per group a right-padded batch, the model's own loss, then clip and AdamW."""

    def __init__(self, model, groups, settings) -> None:
        import torch

        self.model, self.max_grad_norm = model, settings.max_grad_norm
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay,
                                           betas=(settings.adam_beta1, settings.adam_beta2), eps=settings.adam_epsilon)
        self.items = torch.tensor(sum(g.num_tokens() for g in groups))
        self.batches, self.padded, self.logit_positions = [], 0, 0
        for g in groups:
            width = len(g.prompt_ids) + max(len(c) for c in g.completion_ids)
            ids = torch.full((g.size, width), PAD, dtype=torch.long)
            mask = torch.zeros((g.size, width), dtype=torch.long)
            labels = torch.full((g.size, width), -100, dtype=torch.long)
            for i, c in enumerate(g.completion_ids):
                row = g.prompt_ids + c
                ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
                labels[i, len(g.prompt_ids): len(row)] = torch.tensor(c)
            self.batches.append((ids, mask, labels))
            self.padded += ids.numel()
            self.logit_positions += ids.numel()  # the model's own loss takes logits at every position

    def step(self) -> None:
        import torch

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        for ids, mask, labels in self.batches:
            self.model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=self.items).loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()


def learner_shape(core, groups) -> tuple[int, int]:
    """(padded tokens, positions whose vocabulary logits are computed) of the learner's micro-batches."""
    from swarm.logprobs import length_buckets
    from swarm.training import plan_micro_batches

    padded = positions = 0
    for chunk in plan_micro_batches(groups, core.micro_batch_groups, core.micro_batch_tokens):
        prompts = [len(g.prompt_ids) for g in chunk for _ in g.completion_ids]
        completions = [len(c) for g in chunk for c in g.completion_ids]
        for rows in length_buckets(prompts, completions):  # the decoder's runs, each cut to its longest row
            padded += len(rows) * (max(prompts[i] for i in rows) + max(completions[i] for i in rows))
        positions += sum(len(c) for g in chunk for c in g.completion_ids)  # the head runs on real completion tokens
    return padded, positions


def profile(step, top: int = 10) -> list[dict]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    with profiler(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    events = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [{"op": e.key, "shapes": str(e.input_shapes)[:90], "calls": e.count,
             "self_s": round(e.self_cpu_time_total / 1e6, 3), "share": round(e.self_cpu_time_total / total, 3)}
            for e in events[:top]]


def run() -> dict:
    from swarm.config import TrainingSettings
    from swarm.training import LearnerCore

    settings = TrainingSettings()
    base = make_model()
    groups = make_groups(base)
    paths = {"learner": LearnerCore.from_settings(copy.deepcopy(base), PAD, settings),
             "learner_checkpointing": LearnerCore.from_settings(copy.deepcopy(base), PAD,
                                                                settings.model_copy(update={"gradient_checkpointing": True})),
             "bare": Bare(base, groups, settings)}
    steps = {name: (lambda p=p: p.step(groups)) if isinstance(p, LearnerCore) else p.step for name, p in paths.items()}
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for repeat in range(WARMUP + REPEATS):
        for name, step in steps.items():
            started = time.perf_counter()
            step()
            if repeat >= WARMUP:
                seconds[name].append(time.perf_counter() - started)
        print(f"[learner_step] repeat {repeat + 1}/{WARMUP + REPEATS}: "
              + ", ".join(f"{n} {s[-1]:.2f}s" for n, s in seconds.items() if s), flush=True)
    real = sum(len(g.prompt_ids) + len(c) for g in groups for c in g.completion_ids)
    completion = sum(g.num_tokens() for g in groups)
    learner_padded, learner_positions = learner_shape(paths["learner"], groups)
    bare = paths["bare"]
    padded = {"learner": learner_padded, "learner_checkpointing": learner_padded, "bare": bare.padded}
    positions = {"learner": learner_positions, "learner_checkpointing": learner_positions, "bare": bare.logit_positions}
    medians = {n: statistics.median(s) for n, s in seconds.items()}
    results = {n: {"median_s": round(medians[n], 3), "min_s": round(min(s), 3), "max_s": round(max(s), 3),
                   "real_tokens_per_s": round(real / medians[n], 1), "over_bare": round(medians[n] / medians["bare"], 3),
                   "padded_tokens": padded[n], "logit_positions": positions[n]} for n, s in seconds.items()}
    figures = {
        "machine": machine(),
        "model": {"vocab": VOCAB, "parameters": sum(p.numel() for p in base.parameters()), **BODY, "dtype": "float32"},
        "batch": {"groups": GROUPS, "completions_per_group": G, "prompt_tokens": PROMPT, "completion_tokens": completion,
                  "real_tokens": real, "longest_completion": max(len(c) for g in groups for c in g.completion_ids),
                  "eos_terminated": sum(c[-1] == EOS for g in groups for c in g.completion_ids)},
        "settings": {k: getattr(settings, k) for k in ("micro_batch_groups", "micro_batch_tokens", "logprob_chunk",
                                                       "gradient_checkpointing", "max_grad_norm", "learning_rate")}
        | {"loss": settings.loss.name},
        "warmup": WARMUP, "repeats": REPEATS, "seconds": seconds, "results": results,
        "learner_over_bare": results["learner"]["over_bare"], "goal": 1.15,
        "goal_met": results["learner"]["over_bare"] <= 1.15,
        "checkpointing_over_none": round(medians["learner_checkpointing"] / medians["learner"], 3),
        "learner_padding_waste": round(1 - real / learner_padded, 3),
        "profile": {"learner": profile(steps["learner"]), "bare": profile(steps["bare"])},
    }
    write_result("learner_step", figures, markdown(figures))
    return figures


def markdown(f: dict) -> str:
    columns = ["median_s", "min_s", "max_s", "real_tokens_per_s", "over_bare", "padded_tokens", "logit_positions"]
    table = markdown_table(["path"] + columns, [[n] + [r[c] for c in columns] for n, r in f["results"].items()])
    prof = {n: markdown_table(["op", "input shapes", "calls", "self s", "share"],
                              [[e["op"], e["shapes"].replace("|", "/"), e["calls"], e["self_s"], e["share"]] for e in p])
            for n, p in f["profile"].items()}
    b, m = f["batch"], f["model"]
    verdict = "met" if f["goal_met"] else f"missed by {f['learner_over_bare'] / f['goal'] - 1:.0%}"
    return (f"# Learner step against a bare Hugging Face step\n\n{__doc__.strip()}\n\n"
            f"Machine: {f['machine']}.\n\nModel: {m['parameters']:,} parameters. Batch: {b['real_tokens']:,} real tokens ({b['completion_tokens']:,} "
            f"completion), longest completion {b['longest_completion']}, {b['eos_terminated']} of "
            f"{b['groups'] * b['completions_per_group']} EOS-terminated. Learner settings: {f['settings']}. "
            f"Medians of {f['repeats']} alternating steps after {f['warmup']} warm-up each; the optimizer step "
            "(clipping + AdamW) is in every path.\n\n"
            f"{table}\n"
            f"- Learner over bare: **{f['learner_over_bare']:.3f}x** (goal <= {f['goal']}: {verdict}).\n"
            f"- Gradient checkpointing on over off: {f['checkpointing_over_none']:.3f}x.\n"
            f"- Learner padding: {f['results']['learner']['padded_tokens']:,} padded tokens for {b['real_tokens']:,} real "
            f"({f['learner_padding_waste']:.0%} padding; the decoder runs on length buckets of each micro-batch, each padded to its longest prompt and completion). "
            "Logit positions: where the vocabulary logits are computed (the learner: real completion tokens; "
            "the bare model's loss: every position, as Hugging Face computes it).\n\n"
            f"## Profile of one learner step (CPU self time)\n\n{prof['learner']}\n"
            f"## Profile of one bare step\n\n{prof['bare']}")


if __name__ == "__main__":
    import torch

    torch.set_num_threads(2)
    run()
