"""The learner's output layer a chunk at a time with its own backward (swarm/logprobs.py,
ChunkedHeadLogprobs): the same log-probs and the same gradients as the whole-logits path, for
every parameter of a real (tiny) model, tied embeddings included."""

import pytest
import torch

from swarm.logprobs import BUCKET_SLACK, MIN_LOGPROB, ChunkedHeadLogprobs, completion_logprobs, length_buckets
from swarm.model.loading import load_policy


def batch(vocab: int, rows: int = 6, prompt: int = 5, completion: int = 9, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    p_ids = torch.randint(3, vocab, (rows, prompt), generator=gen)
    p_mask = torch.ones_like(p_ids)
    p_mask[0, :2] = 0  # left padding
    c_ids = torch.randint(3, vocab, (rows, completion), generator=gen)
    c_mask = torch.ones_like(c_ids)
    c_mask[1, 4:] = 0  # right padding
    return p_ids, p_mask, c_ids, c_mask


def logprobs_and_grads(model, inputs, **kwargs):
    model.zero_grad(set_to_none=True)
    lp = completion_logprobs(model, *inputs, **kwargs)
    weights = torch.linspace(-1, 1, lp.numel()).reshape(lp.shape)  # a gradient that differs per token
    (lp * weights).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_gives_the_whole_logits_values_and_gradients(temperature):
    model, _ = load_policy("embedded")
    model = model.double().train()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied: both grads meet
    inputs = batch(model.config.vocab_size)
    whole, whole_grads = logprobs_and_grads(model, inputs, temperature=temperature, chunk=0)
    chunked, chunked_grads = logprobs_and_grads(model, inputs, temperature=temperature, chunk=7)  # chunks cut rows
    assert torch.allclose(whole, chunked, atol=1e-10)
    assert whole_grads.keys() == chunked_grads.keys()
    for name in whole_grads:
        assert torch.allclose(whole_grads[name], chunked_grads[name], atol=1e-9), name


def test_chunked_head_floors_impossible_tokens_without_gradient():
    hidden = torch.randn(4, 8, dtype=torch.float64)
    hidden[:, 0] = 1.0  # a constant feature...
    hidden.requires_grad_()
    weight = torch.randn(11, 8, dtype=torch.float64)
    weight[:, 0] = 0.0
    weight[3, 0] = -1e6  # ...that makes token 3 impossible: its log-prob is floored
    weight.requires_grad_()
    tokens = torch.tensor([3, 1, 2, 3])
    out = ChunkedHeadLogprobs.apply(hidden, weight, tokens, 1.0, 3)
    assert out[0] == MIN_LOGPROB and out[3] == MIN_LOGPROB and (out[1:3] > MIN_LOGPROB).all()
    out.sum().backward()
    assert hidden.grad[0].abs().sum() == 0 and hidden.grad[3].abs().sum() == 0
    assert hidden.grad[1].abs().sum() > 0


def test_length_buckets_bound_padding_and_keep_every_row_once():
    prompts = [5, 5, 3, 5, 4, 5, 5, 2]
    completions = [1024, 30, 1000, 64, 500, 31, 900, 1]
    buckets = length_buckets(prompts, completions)
    assert sorted(i for rows in buckets for i in rows) == list(range(len(prompts)))
    for rows in buckets:
        padded = len(rows) * (max(prompts[i] for i in rows) + max(completions[i] for i in rows))
        assert padded <= BUCKET_SLACK * sum(prompts[i] + completions[i] for i in rows)
    assert len(buckets) > 1  # the 30-token completions do not ride with the 1,024-token one
    capped = length_buckets(prompts, completions, max_buckets=2)
    assert len(capped) <= 2 and sorted(i for rows in capped for i in rows) == list(range(len(prompts)))


def test_bucketed_decoder_runs_give_the_padded_values_and_gradients():
    """Rows of very different lengths run in several cut-down decoder runs: the same log-probs and
    gradients as one padded run (the whole-logits path)."""
    model, _ = load_policy("embedded")
    model = model.double().train()
    p_ids, p_mask, c_ids, c_mask = batch(model.config.vocab_size, rows=6, prompt=6, completion=24, seed=1)
    for row, (prompt, completion) in enumerate([(6, 24), (3, 2), (6, 20), (1, 1), (4, 3), (6, 0)]):
        p_mask[row] = 0
        p_mask[row, 6 - prompt :] = 1
        c_mask[row] = 0
        c_mask[row, :completion] = 1
    lengths = (p_mask.sum(1).tolist(), c_mask.sum(1).tolist())
    assert len(length_buckets(*lengths)) >= 2
    whole, whole_grads = logprobs_and_grads(model, (p_ids, p_mask, c_ids, c_mask), chunk=0)
    bucketed, bucketed_grads = logprobs_and_grads(model, (p_ids, p_mask, c_ids, c_mask), chunk=5)
    assert torch.allclose(whole, bucketed, atol=1e-10)
    assert (bucketed[c_mask == 0] == 0).all() and (bucketed[c_mask == 1] < 0).all()
    for name in whole_grads:
        assert torch.allclose(whole_grads[name], bucketed_grads[name], atol=1e-9), name
