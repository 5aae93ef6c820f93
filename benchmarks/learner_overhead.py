"""Learner-step overhead of the GEPO loss: one optimizer step with GEPO (advantages, group
expectation, clipping, KL penalty, metrics) against a plain forward / backward / step on the same
tokens and model (loss = mean token log-prob). Target: ratio <= 1.05.

Timings alternate between the two variants so that drift of the machine affects both equally, and
the median of each is reported.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import markdown_table, write_result
from swarm.advantages import group_advantages
from swarm.logprobs import completion_logprobs
from swarm.losses import LossConfig, LossInputs, compute_loss


def make_batch(vocab: int, prompts: int, group: int, prompt_len: int, completion_len: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    b = prompts * group
    prompt_ids = torch.randint(3, vocab, (b, prompt_len), generator=gen)
    completion_ids = torch.randint(3, vocab, (b, completion_len), generator=gen)
    completion_mask = torch.ones(b, completion_len)
    lengths = torch.randint(completion_len // 2, completion_len + 1, (b,), generator=gen)
    completion_mask[torch.arange(completion_len)[None, :] >= lengths[:, None]] = 0
    rewards = torch.randint(0, 2, (b,), generator=gen).float()
    groups = torch.arange(prompts).repeat_interleave(group)
    return prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask, rewards, groups


def run(repeats: int = 15, model_dir: str | None = None) -> dict:
    from swarm.model.loading import load_policy

    model, tokenizer = load_policy(model_dir or "embedded")
    model.train()
    vocab = model.config.vocab_size
    p_ids, p_mask, c_ids, c_mask, rewards, groups = make_batch(vocab, prompts=16, group=8, prompt_len=24, completion_len=24)
    with torch.no_grad():
        sampler = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask) + 0.05 * torch.randn(c_ids.shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    config = LossConfig(name="gepo")

    def plain_step():
        logprobs = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask)
        loss = -(logprobs * c_mask).sum() / c_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def gepo_step():
        logprobs = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask)
        adv = group_advantages(rewards, groups, "std")
        out = compute_loss(LossInputs(logprobs, sampler, c_mask, adv, groups), config)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()
        out.metrics_as_floats()  # a learner logs these every step: include the cost

    for _ in range(3):  # warm-up
        plain_step()
        gepo_step()
    plain, gepo = [], []
    for _ in range(repeats):
        for fn, store in ((plain_step, plain), (gepo_step, gepo)):
            started = time.perf_counter()
            fn()
            store.append(time.perf_counter() - started)
    figures = {
        "batch": {"sequences": int(c_ids.size(0)), "prompt_tokens": int(p_ids.size(1)), "completion_tokens": int(c_ids.size(1))},
        "model_parameters": sum(p.numel() for p in model.parameters()),
        "plain_step_s_median": statistics.median(plain),
        "gepo_step_s_median": statistics.median(gepo),
        "ratio": statistics.median(gepo) / statistics.median(plain),
        "target_ratio_at_most": 1.05,
        "repeats": repeats,
    }
    md = "# Learner-step overhead of the GEPO loss\n\n" + markdown_table(
        ["variant", "median step (s)"],
        [["plain forward/backward/step", figures["plain_step_s_median"]], ["GEPO step", figures["gepo_step_s_median"]]],
    ) + f"\nratio GEPO / plain: **{figures['ratio']:.3f}** (target <= 1.05), {repeats} alternating repeats, " \
        f"{figures['batch']['sequences']} sequences x {figures['batch']['completion_tokens']} completion tokens.\n"
    write_result("learner_overhead", figures, md)
    return figures
