"""Per-token log-probs of chosen tokens, the one computation samplers and learners must agree on.

A sampler records log q(y_t) under the distribution it actually sampled from: logits divided by the
temperature, then top-k and top-p filtering, renormalised. A learner recomputes log p(y_t) with the
same processing, so that with equal weights the two agree to float precision (tests: <= 1e-4 in
fp32) and the importance ratio p/q is exactly 1 on fresh data.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.utils.checkpoint
from torch import Tensor

# A token outside the top-k / top-p set has probability 0 under the processed distribution. That
# happens to a stale sampler's token under a newer learner; a floor keeps it finite (an -inf would
# turn into NaN as soon as it meets a 0 in a mask) while still meaning "essentially impossible".
MIN_LOGPROB = -1e4

# Length buckets of the learner's decoder runs (length_buckets): padded tokens at most 1.25x the
# real ones per bucket, and at most 8 decoder runs per micro-batch.
BUCKET_SLACK = 1.25
MAX_BUCKETS = 8


def process_logits(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """(..., V) raw logits -> processed logits of the sampling distribution (filtered entries -inf).

    Same order as transformers' generation (temperature, then top-k, then top-p), so that a
    distribution recorded from `generate`'s processed scores matches this one."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    logits = logits.float() / temperature
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - top_p)
        remove_sorted[..., -1:] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def gather_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """logits (B, T, V), tokens (B, T) -> log-prob of each token under the processed distribution (B, T).

    Uses logsumexp rather than a full log_softmax tensor: (B, T, V) floats are the biggest
    allocation of a learner step, and this keeps one of them instead of two."""
    processed = process_logits(logits, temperature, top_k, top_p)
    chosen = processed.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return (chosen - torch.logsumexp(processed, dim=-1)).clamp(min=MIN_LOGPROB)


def head_chunk_logprobs(logits: Tensor, tokens: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """One chunk's (rows, V) logits in the compute dtype -> float32 (log p(tokens), logsumexp): the
    forward's full-vocabulary pass of ChunkedHeadLogprobs, eager or compiled (compiled_head_passes)."""
    logits = logits.float()  # a copy under autocast; the matmul's own result otherwise: both ours to change
    if temperature != 1.0:
        logits = logits.div_(temperature)
    totals = torch.logsumexp(logits, dim=-1)
    return logits.gather(-1, tokens[:, None]).squeeze(-1) - totals, totals


def head_chunk_logits_grad(logits: Tensor, totals: Tensor, grad: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    """d sum(grad * log p(tokens)) / d logits = grad * (onehot(tokens) - softmax(logits / T)) / T, in the
    logits' dtype: the backward's full-vocabulary pass of ChunkedHeadLogprobs, eager or compiled.
    Eager, each step is a pass over (rows, V) float32, in place where it can be."""
    g = grad[:, None]
    if temperature == 1.0 and logits.dtype in (torch.bfloat16, torch.float16):
        shifted = torch.sub(logits, totals[:, None])  # float32 by promotion: no separate cast pass
    else:
        shifted = logits.float()
        shifted = (shifted.div_(temperature) if temperature != 1.0 else shifted).sub_(totals[:, None])
    dlogits = shifted.exp_().mul_(-g)
    dlogits.scatter_add_(1, tokens[:, None], g)
    if temperature != 1.0:
        dlogits.div_(temperature)
    return dlogits.to(logits.dtype)


def fusable_head_chunk_logits_grad(logits: Tensor, totals: Tensor, grad: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    """head_chunk_logits_grad written for torch.compile: out of place, the one-hot term a comparison with
    the column index rather than a scatter, so that the whole pass is one elementwise kernel that reads the
    logits once and writes their gradient once (eager, the comparison would be one more full pass)."""
    probs = torch.exp(logits.float() / temperature - totals[:, None])
    onehot = torch.arange(logits.size(-1), device=logits.device)[None, :] == tokens[:, None]
    return (grad[:, None] * (onehot.float() - probs) / temperature).to(logits.dtype)


class HeadPasses(NamedTuple):
    """The two full-vocabulary passes of ChunkedHeadLogprobs (see head_chunk_logprobs, head_chunk_logits_grad)."""

    logprobs: Callable[[Tensor, Tensor, float], tuple[Tensor, Tensor]]
    logits_grad: Callable[[Tensor, Tensor, Tensor, Tensor, float], Tensor]


EAGER_HEAD = HeadPasses(head_chunk_logprobs, head_chunk_logits_grad)


@functools.cache
def compiled_head_passes() -> HeadPasses:
    """The head's passes under torch.compile: each becomes one fused kernel that reads the chunk's
    compute-dtype logits once (and, in backward, writes their gradient once) instead of the eager
    path's five to six float32 passes over (chunk, vocabulary). Compiled on first use (seconds), with
    dynamic shapes (the last chunk is shorter); the results equal the eager ones up to float rounding
    (tests/learning/test_learner_speed.py)."""
    return HeadPasses(torch.compile(head_chunk_logprobs, dynamic=True),
                      torch.compile(fusable_head_chunk_logits_grad, dynamic=True))


class ChunkedHeadLogprobs(torch.autograd.Function):
    """log p(token) under softmax(hidden @ weight.T / temperature), a chunk of rows at a time, with
    its own backward: only one chunk's (rows, vocabulary) logits exist at once, in forward and again
    in backward, and each full-vocabulary pass is done once (in place where it can be).

    The output layer, log-softmax and gather of a learner step in one function, as Liger-Kernel's
    fused linear cross-entropy does for a cross-entropy loss (github.com/linkedin/Liger-Kernel,
    ops/fused_linear_cross_entropy.py). Its gradient there is taken in forward, since the loss's
    gradient is known then; a policy loss's gradient per token is known only once every token's
    log-prob is, so backward recomputes each chunk's logits: one more pass of the output layer than
    a whole-logits step, against (chunk_count - 1) / chunk_count of its memory. Against the
    checkpointed per-chunk path this saves a second log-softmax, the temperature divisions of the
    recompute and the zero-filled gradient of the gather (profile: benchmarks/learner_step.py).

    hidden (N, H), weight (V, H) (a Linear head without bias; tied to the embedding or not),
    tokens (N,), passes: EAGER_HEAD or compiled_head_passes() -> (N,) float32, floored at MIN_LOGPROB
    (no gradient below the floor)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, tokens: Tensor, temperature: float, chunk: int,
                passes: HeadPasses = EAGER_HEAD) -> Tensor:
        # under autocast the logits are computed in its dtype, as the model's own head would be; backward
        # (not under autocast) does the same by hand
        compute = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) else weight.dtype
        out = torch.empty(hidden.size(0), dtype=torch.float32, device=hidden.device)
        totals = torch.empty_like(out)
        with torch.profiler.record_function("logprobs/head_forward"):
            w = weight.to(compute)
            for start in range(0, hidden.size(0), chunk):
                end = start + chunk
                out[start:end], totals[start:end] = passes.logprobs(hidden[start:end].to(compute) @ w.t(), tokens[start:end],
                                                                    temperature)
        ctx.save_for_backward(hidden, weight, tokens, totals, out)
        ctx.temperature, ctx.chunk, ctx.compute, ctx.passes = temperature, chunk, compute, passes
        return out.clamp(min=MIN_LOGPROB)

    @staticmethod
    def backward(ctx, grad: Tensor):
        hidden, weight, tokens, totals, out = ctx.saved_tensors
        grad = grad.float() * (out >= MIN_LOGPROB)  # the floor passes no gradient
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # summed over chunks in float32 at least (a bf16 sum of many chunks would lose the small ones)
        grad_weight = torch.zeros(weight.shape, dtype=torch.promote_types(ctx.compute, torch.float32),
                                  device=weight.device) if ctx.needs_input_grad[1] else None
        with torch.profiler.record_function("logprobs/head_backward"):
            w = weight.to(ctx.compute)
            for start in range(0, hidden.size(0), ctx.chunk):
                end = start + ctx.chunk
                h = hidden[start:end].to(ctx.compute)
                dlogits = ctx.passes.logits_grad(h @ w.t(), totals[start:end], grad[start:end], tokens[start:end],
                                                 ctx.temperature)
                if grad_hidden is not None:
                    grad_hidden[start:end] = (dlogits @ w).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight += (dlogits.t() @ h).to(grad_weight.dtype)
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None


def completion_logprobs(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    chunk: int = 0,
    max_buckets: int = MAX_BUCKETS,
    compiled_head: bool = False,
) -> Tensor:
    """Learner side: log-probs (B, Tc) of completion tokens given left-padded prompts.

    prompt_ids / prompt_mask: (B, Tp), left-padded (as samplers generate).
    completion_ids / completion_mask: (B, Tc), right-padded.
    Position ids follow the attention mask, as in generation, so padding never shifts positions.
    chunk > 0: the vocabulary logits of at most `chunk` completion tokens (over all sequences) exist
    at a time (the output layer runs per chunk, and again per chunk in backward), so the float32
    (B, Tc, vocab) logits of the whole micro-batch never do: at most chunk x vocab x 4 bytes per
    copy (2048 tokens of Qwen3's 151,936-token vocabulary: 1.2 GB), and the decoder runs on buckets of
    rows of similar length (length_buckets), each cut to its own longest prompt and completion: no
    short completion is padded to the longest (max_buckets=1: one run, padded to the longest). The result is the same. Models without a separate
    decoder and output layer take the whole-logits path. compiled_head: the chunked head's full-vocabulary
    passes under torch.compile (compiled_head_passes; for GPUs, where they are memory-bound).
    """
    tp = prompt_ids.size(1)
    if hasattr(model, "get_base_model"):  # a LoRA run's PEFT wrapper: its adapters live inside the wrapped model
        model = model.get_base_model()
    head = model.get_output_embeddings() if chunk > 0 else None
    decoder = getattr(model, model.base_model_prefix, None) if head is not None else None
    if decoder is None:
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention = torch.cat([prompt_mask, completion_mask], dim=1).long()
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids, use_cache=False)
        # logits at position j predict token j + 1: completion token t is predicted at tp + t - 1.
        logits = out.logits[:, tp - 1 : -1, :]
        logprobs = gather_logprobs(logits, completion_ids, temperature, top_k, top_p)
        return logprobs.masked_fill(completion_mask == 0, 0.0)  # padding carries no log-prob

    b, t = completion_ids.shape
    flat_hidden, flat_at = [], []  # real completion tokens' hidden states, and where they sit in (B * Tc)
    # the rows' lengths reach the host once (one sync), not once per bucket: a sync between buckets would
    # leave a GPU idle while the next bucket's first kernels are launched
    prompt_lengths, completion_lengths = torch.stack([prompt_mask.sum(1).int(), completion_mask.sum(1).int()]).tolist()
    for rows in length_buckets(prompt_lengths, completion_lengths, max_buckets=max_buckets):
        widths = max(max(prompt_lengths[i] for i in rows), 1), max(max(completion_lengths[i] for i in rows), 1)
        real = sum(completion_lengths[i] for i in rows)
        hidden, at = _bucket_hidden(decoder, rows, widths, real, prompt_ids, prompt_mask, completion_ids, completion_mask)
        flat_hidden.append(hidden)
        flat_at.append(at)
    flat_hidden, flat_at = torch.cat(flat_hidden), torch.cat(flat_at)
    flat_tokens = completion_ids.reshape(b * t)[flat_at]
    if isinstance(head, torch.nn.Linear) and head.bias is None and not top_k and top_p >= 1.0:
        picked = ChunkedHeadLogprobs.apply(flat_hidden, head.weight, flat_tokens, float(temperature), chunk,
                                           compiled_head_passes() if compiled_head else EAGER_HEAD)
    else:  # top-k / top-p filter the logits first, a biased head adds to them: the checkpointed path

        def chunk_logprobs(h: Tensor, tokens: Tensor) -> Tensor:
            return gather_logprobs(head(h), tokens, temperature, top_k, top_p)

        parts = []
        for start in range(0, flat_tokens.size(0), chunk):
            h, tokens = flat_hidden[start : start + chunk], flat_tokens[start : start + chunk]
            if torch.is_grad_enabled() and h.requires_grad:
                # backward recomputes this chunk's logits instead of keeping them
                parts.append(torch.utils.checkpoint.checkpoint(chunk_logprobs, h, tokens, use_reentrant=False))
            else:
                parts.append(chunk_logprobs(h, tokens))
        picked = torch.cat(parts) if parts else flat_hidden.new_zeros(0, dtype=torch.float32)
    # padding is never computed, and carries no log-prob
    return picked.new_zeros(b * t).index_put((flat_at,), picked).reshape(b, t)


def length_buckets(prompt_lengths: list[int], completion_lengths: list[int], *, slack: float = BUCKET_SLACK,
                   max_buckets: int = MAX_BUCKETS) -> list[list[int]]:
    """Rows of a micro-batch into runs of the decoder of similar length, so that a 30-token
    completion is not padded to its neighbour's 1,024: longest first, a row joins the current
    bucket while the bucket's padded tokens stay within `slack` x its real tokens. Too many buckets
    (many small forwards keep a GPU idle between launches) widen the slack until they fit
    `max_buckets`. The result does not depend on how rows are bucketed, only the work does."""
    order = sorted(range(len(prompt_lengths)), key=lambda i: -(prompt_lengths[i] + completion_lengths[i]))
    while True:
        buckets: list[list[int]] = []
        width_p = width_c = real = 0
        for i in order:
            p, c = prompt_lengths[i], completion_lengths[i]
            rows = len(buckets[-1]) + 1 if buckets else 0
            padded = rows * (max(width_p, p) + max(width_c, c))
            if buckets and padded <= slack * (real + p + c):
                buckets[-1].append(i)
                width_p, width_c, real = max(width_p, p), max(width_c, c), real + p + c
            else:
                buckets.append([i])
                width_p, width_c, real = p, c, p + c
        if len(buckets) <= max_buckets:
            return [sorted(rows) for rows in buckets]
        slack *= 1.5


def _bucket_hidden(decoder, rows: list[int], widths: tuple[int, int], real: int, prompt_ids: Tensor, prompt_mask: Tensor,
                   completion_ids: Tensor, completion_mask: Tensor) -> tuple[Tensor, Tensor]:
    """One decoder run on `rows`, cut to their own longest prompt (prompts are left-padded) and
    completion (right-padded) -> the hidden states that predict their real completion tokens
    (N, H) and those tokens' flat positions in (B * Tc). Positions follow the attention mask, as in
    generation, so neither cut shifts them. widths: the rows' longest prompt and completion (at least 1),
    known on the host, and `real`: their real completion tokens, so that nothing here waits for the device
    (transformers' mask code still reads one value back per run: whether the mask can be skipped, or with
    none, whether rows are packed)."""
    index = torch.tensor(rows, device=prompt_ids.device)
    tp, t = prompt_ids.size(1), completion_ids.size(1)
    keep_p, keep_c = widths
    p_mask, c_mask = prompt_mask[index, tp - keep_p :], completion_mask[index, :keep_c]
    input_ids = torch.cat([prompt_ids[index, tp - keep_p :], completion_ids[index, :keep_c]], dim=1)
    attention = torch.cat([p_mask, c_mask], dim=1).long()
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    hidden = decoder(input_ids=input_ids, attention_mask=attention, position_ids=position_ids,
                     use_cache=False).last_hidden_state[:, keep_p - 1 : -1, :]
    # the real tokens' places, without a boolean index (its count would be read back from the device)
    real = torch.nonzero_static(c_mask.reshape(-1), size=real).squeeze(1)
    at = (index[:, None] * t + torch.arange(keep_c, device=index.device)).reshape(-1)[real]
    return hidden.reshape(-1, hidden.size(-1))[real], at
