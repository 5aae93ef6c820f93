"""The learner's speed options (swarm/training.py: TrainingSettings.torch_compile and
optimizer_implementation) take the same step as the eager, torch-default learner up to float
rounding, on a real (tiny) Qwen3; and the head's passes (eager, and as compiled) give what their formula does."""

import copy

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from swarm.config import TrainingSettings
from swarm.logprobs import EAGER_HEAD, fusable_head_chunk_logits_grad
from swarm.rollouts import RolloutGroup
from swarm.training import LearnerCore, compile_decoder_layers, make_adamw

PAD, VOCAB = 0, 512


def tiny_qwen3() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True,
                         bos_token_id=PAD, eos_token_id=VOCAB - 1, pad_token_id=PAD)
    return Qwen3ForCausalLM(config)


def groups(seed: int = 0, uneven: bool = True) -> list[RolloutGroup]:
    """Two groups of 4, prompts and completions of different lengths (padding and several length buckets),
    or (uneven=False) all of one length: one shape to compile for."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (prompt, lengths) in enumerate([(6, [12, 3, 12, 7]), (9, [5, 5, 11, 2])] if uneven else [(6, [8] * 4)] * 2):
        completions = [torch.randint(1, VOCAB - 1, (n,), generator=g).tolist() for n in lengths]
        out.append(RolloutGroup(f"p{i}", torch.randint(1, VOCAB - 1, (prompt,), generator=g).tolist(), completions,
                                [(-6.0 + 0.1 * torch.randn(len(c), generator=g)).tolist() for c in completions],
                                [1.0, 0.0, 1.0, 0.0], version=0, sampler_id="s"))
    return out


def two_steps(base, uneven: bool = True, **options) -> tuple[list[dict], dict[str, torch.Tensor]]:
    model = copy.deepcopy(base)
    core = LearnerCore(model, PAD, learning_rate=1e-3, lr_warmup_steps=0, micro_batch_groups=1, logprob_chunk=8, **options)
    metrics = [core.step(groups(0, uneven)), core.step(groups(1, uneven))]
    return metrics, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_steps(a, b, atol: float) -> None:
    for step_a, step_b in zip(a[0], b[0]):
        for key in ("loss", "grad_norm", "fresh_logprob_gap"):
            assert step_a[key] == pytest.approx(step_b[key], rel=1e-5, abs=1e-6, nan_ok=True), key
    for name, weight in a[1].items():
        assert torch.allclose(weight, b[1][name], atol=atol), name


def test_fused_adamw_takes_the_for_loop_step():
    base = tiny_qwen3()
    reference = two_steps(base, optimizer_implementation="for_loop")
    for implementation in ("fused", "foreach"):
        assert_same_steps(two_steps(base, optimizer_implementation=implementation), reference, atol=1e-6)
    params = list(base.parameters())
    assert make_adamw(params, "fused", lr=1e-3).defaults["fused"] is True
    assert not make_adamw(params, "auto", lr=1e-3).defaults.get("fused")  # CPU: torch's own choice
    with pytest.raises(ValueError, match="unknown optimizer implementation 'adam8bit'"):
        make_adamw(params, "adam8bit", lr=1e-3)


@pytest.mark.slow
def test_compiled_layers_and_head_take_the_eager_step():
    base = tiny_qwen3()  # one shape throughout: each new one is compiled anew (tens of seconds on a CPU)
    eager = two_steps(base, uneven=False)
    torch._dynamo.reset()
    assert_same_steps(two_steps(base, uneven=False, torch_compile="all"), eager, atol=1e-4)  # lr 1e-3 moves weights ~2e-3
    model = copy.deepcopy(base)
    assert compile_decoder_layers(model) == 2
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)


def test_compile_options_are_checked():
    base = tiny_qwen3()
    with pytest.raises(ValueError, match="unknown torch_compile 'everything'"):
        LearnerCore(copy.deepcopy(base), PAD, torch_compile="everything")
    with pytest.raises(ValueError, match="has no decoder layer list"):
        compile_decoder_layers(torch.nn.Linear(2, 2))
    assert TrainingSettings().torch_compile == "off" and TrainingSettings().optimizer_implementation == "auto"
    with pytest.raises(ValueError, match="torch_compile"):
        TrainingSettings(torch_compile="yes")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_passes_in_bf16_match_their_formula(temperature):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(5, 301, generator=g)).to(torch.bfloat16)
    tokens = torch.randint(0, 301, (5,), generator=g)
    grad = torch.randn(5, generator=g)
    picked, totals = EAGER_HEAD.logprobs(logits.clone(), tokens, temperature)
    scaled = logits.float() / temperature
    assert torch.allclose(totals, torch.logsumexp(scaled, -1), atol=1e-6)
    assert torch.allclose(picked, scaled.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1), atol=1e-5)
    dlogits = EAGER_HEAD.logits_grad(logits.clone(), totals, grad, tokens, temperature)
    onehot = torch.nn.functional.one_hot(tokens, 301).float()
    expected = grad[:, None] * (onehot - scaled.softmax(-1)) / temperature
    fusable = fusable_head_chunk_logits_grad(logits, totals, grad, tokens, temperature)  # what is compiled
    for result in (dlogits, fusable):
        assert result.dtype == torch.bfloat16
        assert torch.allclose(result.float(), expected.to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2)
