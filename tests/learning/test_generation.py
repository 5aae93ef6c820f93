"""Generation backends: sampler log-probs equal learner recomputation, EOS handling, grouping."""

import pytest
import torch

from swarm.generation import SamplingParams, make_backend
from swarm.generation.transformers_backend import PROMPT_PAD_MULTIPLE, TransformersBackend
from swarm.logprobs import completion_logprobs
from swarm.model.loading import load_policy
from swarm.tied_weights import unique_state
from swarm.tasks.synthetic import ArithmeticTask


@pytest.fixture(scope="module")
def backend():
    model, tokenizer = load_policy("embedded")
    return TransformersBackend(model, tokenizer, batch_tokens=1024)  # several calls per test


def pad_batch(gens, tokenizer):
    """Left-padded prompts and right-padded completions, as a learner assembles them."""
    prompts = [g.prompt_ids for g in gens for _ in g.completion_ids]
    completions = [c for g in gens for c in g.completion_ids]
    sampler_lp = [lp for g in gens for lp in g.completion_logprobs]
    tp, tc = max(map(len, prompts)), max(map(len, completions))
    pad = tokenizer.pad_token_id
    p_ids = torch.tensor([[pad] * (tp - len(p)) + p for p in prompts])
    p_mask = torch.tensor([[0] * (tp - len(p)) + [1] * len(p) for p in prompts])
    c_ids = torch.tensor([c + [pad] * (tc - len(c)) for c in completions])
    c_mask = torch.tensor([[1] * len(c) + [0] * (tc - len(c)) for c in completions])
    s_lp = torch.tensor([lp + [0.0] * (tc - len(lp)) for lp in sampler_lp])
    return p_ids, p_mask, c_ids, c_mask, s_lp


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.7),
        dict(temperature=1.0, top_k=5),
        dict(temperature=0.9, top_p=0.8),
    ],
    ids=["t1", "t0.7", "topk5", "topp0.8"],
)
def test_sampler_logprobs_equal_learner_recompute(backend, params):
    prompts = [p.prompt for p in ArithmeticTask(2).problems("test")[:6]]
    sp = SamplingParams(num_completions=4, max_new_tokens=16, seed=1, **params)
    gens = backend.generate(prompts, sp)
    p_ids, p_mask, c_ids, c_mask, s_lp = pad_batch(gens, backend.tokenizer)
    with torch.no_grad():
        learner = completion_logprobs(
            backend.model, p_ids, p_mask, c_ids, c_mask, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p
        )
    diff = ((learner - s_lp).abs() * c_mask).max().item()
    assert diff <= 1e-4, diff
    assert torch.isfinite(learner[c_mask.bool()]).all()


def test_a_static_kv_cache_samples_and_records_as_the_learner_recomputes(backend):
    """The CUDA path's static KV cache (compiled by transformers on a GPU, not here): the same
    agreement with the learner, and the same completions for the same seed as the dynamic cache."""
    static = TransformersBackend(backend.model, backend.tokenizer, static_cache=True)
    assert static.static_cache and not backend.static_cache  # on by itself only on CUDA
    prompts = [p.prompt for p in ArithmeticTask(2).problems("test")[:3]]
    sp = SamplingParams(num_completions=2, max_new_tokens=10, seed=5, temperature=0.8, top_p=0.9)
    widths = []  # each call's prompt width: padded to a multiple of 64 (one compile per shape on a GPU)
    sample = static.sample
    static.sample = lambda ids, mask, params: (widths.append(ids.size(1)), sample(ids, mask, params))[1]
    gens = static.generate(prompts, sp)
    assert widths and all(w % PROMPT_PAD_MULTIPLE == 0 for w in widths), widths
    p_ids, p_mask, c_ids, c_mask, s_lp = pad_batch(gens, backend.tokenizer)
    with torch.no_grad():
        learner = completion_logprobs(backend.model, p_ids, p_mask, c_ids, c_mask, temperature=0.8, top_p=0.9)
    assert ((learner - s_lp).abs() * c_mask).max().item() <= 1e-4
    assert [g.completion_ids for g in gens] == [g.completion_ids for g in backend.generate(prompts, sp)]


def test_groups_eos_and_lengths(backend):
    problems = ArithmeticTask(2).problems("test")[:5]
    gens = backend.generate([p.prompt for p in problems], SamplingParams(num_completions=3, max_new_tokens=12, seed=0))
    eos = backend.tokenizer.eos_token_id
    assert len(gens) == 5
    for problem, gen in zip(problems, gens):
        assert backend.tokenizer.decode(gen.prompt_ids) == problem.prompt
        assert len(gen.completion_ids) == len(gen.completion_logprobs) == len(gen.texts) == len(gen.finished) == 3
        for ids, lps, finished, text in zip(gen.completion_ids, gen.completion_logprobs, gen.finished, gen.texts):
            assert len(ids) == len(lps) <= 12
            assert eos not in ids[:-1]  # nothing after the first EOS is kept
            assert finished == (ids[-1] == eos)
            assert text == backend.tokenizer.decode(ids, skip_special_tokens=True)
            assert all(lp <= 0 for lp in lps)


def test_truncated_completions_are_marked_unfinished(backend):
    gens = backend.generate(["Compute 1+1. Answer in \\boxed{}.\n"], SamplingParams(num_completions=2, max_new_tokens=3, seed=0))
    assert all(len(ids) == 3 and not fin for ids, fin in zip(gens[0].completion_ids, gens[0].finished))


def test_greedy_is_deterministic_and_seeded_sampling_repeats(backend):
    prompts = [p.prompt for p in ArithmeticTask(2).problems("test")[:4]]
    greedy = SamplingParams(num_completions=1, temperature=0, max_new_tokens=12)
    assert [g.texts for g in backend.generate(prompts, greedy)] == [g.texts for g in backend.generate(prompts, greedy)]
    sampled = SamplingParams(num_completions=4, max_new_tokens=12, seed=5)
    first = [g.completion_ids for g in backend.generate(prompts, sampled)]
    assert first == [g.completion_ids for g in backend.generate(prompts, sampled)]


def test_weight_update_changes_generation(backend):
    prompts = ["Compute 2+2. Answer in \\boxed{}.\n"]
    greedy = SamplingParams(num_completions=1, temperature=0, max_new_tokens=12)
    before = backend.generate(prompts, greedy)[0].completion_logprobs[0]
    original = {k: v.clone() for k, v in unique_state(backend.model).items()}  # a tied parameter once, as published
    perturbed = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in original.items()}
    backend.load_state_dict(perturbed)
    after = backend.generate(prompts, greedy)[0].completion_logprobs[0]
    backend.load_state_dict(original)
    assert before != after
    assert backend.generate(prompts, greedy)[0].completion_logprobs[0] == pytest.approx(before, abs=1e-6)


def test_unknown_backend_and_missing_model_are_named(tmp_path):
    with pytest.raises(ValueError, match="unknown generation backend 'tgi'"):
        make_backend("tgi", "embedded")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_policy(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_policy("./no/such/model")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM needs a CUDA device")
def test_vllm_logprobs_match_learner_recompute():
    from swarm.model.loading import resolve_model_dir

    pytest.importorskip("vllm")
    backend = make_backend("vllm", resolve_model_dir("embedded"), dtype="float32", gpu_memory_utilization=0.3)
    prompts = [p.prompt for p in ArithmeticTask(2).problems("test")[:6]]
    sp = SamplingParams(num_completions=4, max_new_tokens=16, seed=1)
    gens = backend.generate(prompts, sp)
    model, tokenizer = load_policy("embedded", device="cuda")
    p_ids, p_mask, c_ids, c_mask, s_lp = (t.cuda() for t in pad_batch(gens, tokenizer))
    with torch.no_grad():
        learner = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, temperature=1.0)
    assert ((learner - s_lp).abs() * c_mask).max().item() <= 1e-3
    # in-place weight update: perturbed weights change the recorded log-probs
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    backend.load_state_dict(state)
    again = backend.generate(prompts[:1], SamplingParams(num_completions=1, temperature=0, max_new_tokens=8))
    assert again[0].completion_logprobs[0] != gens[0].completion_logprobs[0][: len(again[0].completion_logprobs[0])]


def test_tokens_outside_the_learners_top_k_stay_finite(backend):
    """A stale sampler's token can fall outside a newer learner's top-k: its log-prob is floored,
    padding is zero, and a loss on it stays finite."""
    from swarm.losses import LossInputs, compute_loss

    gens = backend.generate(["Compute 3+4. Answer in \\boxed{}.\n"] * 2, SamplingParams(num_completions=2, max_new_tokens=8, seed=0))
    p_ids, p_mask, c_ids, c_mask, s_lp = pad_batch(gens, backend.tokenizer)
    c_ids = torch.where(c_mask.bool(), torch.randint(3, 90, c_ids.shape), c_ids)  # unlikely tokens
    c_mask[0, -2:] = 0
    learner = completion_logprobs(backend.model, p_ids, p_mask, c_ids, c_mask, top_k=1)
    assert torch.isfinite(learner).all()
    assert (learner[c_mask == 0] == 0).all()
    out = compute_loss(LossInputs(learner, s_lp, c_mask, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.tensor([0, 0, 1, 1])))
    assert torch.isfinite(out.loss)


def test_each_generate_call_holds_at_most_its_token_budget_of_rows(backend):
    """Rows per call follow a token budget, rows x (longest prompt + new tokens), so the KV cache is
    bounded whatever the prompts' lengths; every prompt is in exactly one call, in order, and a
    prompt alone over the budget still gets its call."""
    tokenizer = backend.tokenizer
    prompts = [p.prompt * (1 + i % 3) for i, p in enumerate(ArithmeticTask(2).problems("test")[:11])]
    params = SamplingParams(num_completions=4, max_new_tokens=16)
    lengths = {p: len(tokenizer(p)["input_ids"]) for p in prompts}
    small = TransformersBackend(backend.model, tokenizer, batch_tokens=4 * (max(lengths.values()) + 16) * 3)
    calls = small.batches(prompts, params)
    assert [p for call in calls for p in call] == prompts
    assert len(calls) > 1
    for call in calls:
        assert len(call) * 4 * (max(lengths[p] for p in call) + 16) <= small.batch_tokens
    tiny = TransformersBackend(backend.model, tokenizer, batch_tokens=1)
    assert [len(call) for call in tiny.batches(prompts, params)] == [1] * len(prompts)


def test_the_models_own_sampling_settings_neither_change_what_is_sampled_nor_what_is_recorded(backend):
    """A model's generation_config may set top-k, top-p or a temperature; generate would apply them
    after any logits processor it is given. Here it would keep only the most likely token: sampling
    must still follow the run's settings, recorded as the learner recomputes them."""
    config = backend.model.generation_config
    saved = (config.top_k, config.top_p, config.temperature)
    config.top_k, config.top_p, config.temperature = 1, 0.5, 0.1
    try:
        prompts = [p.prompt for p in ArithmeticTask(2).problems("test")[:4]]
        sp = SamplingParams(num_completions=4, max_new_tokens=12, seed=3, temperature=3.0)
        gens = backend.generate(prompts, sp)
    finally:
        config.top_k, config.top_p, config.temperature = saved
    p_ids, p_mask, c_ids, c_mask, s_lp = pad_batch(gens, backend.tokenizer)
    with torch.no_grad():
        learner = completion_logprobs(backend.model, p_ids, p_mask, c_ids, c_mask, temperature=3.0)
        logits = backend.model(input_ids=torch.cat([p_ids, c_ids], 1), attention_mask=torch.cat([p_mask, c_mask], 1),
                               position_ids=(torch.cat([p_mask, c_mask], 1).cumsum(-1) - 1).clamp(min=0)).logits
    assert ((learner - s_lp).abs() * c_mask).max().item() <= 1e-4
    most_likely = logits[:, p_ids.size(1) - 1 : -1].argmax(-1)
    assert ((most_likely != c_ids) & c_mask.bool()).any()  # not only the top token: the config's top_k=1 was not applied
