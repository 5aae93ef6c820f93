"""LoRA runs' parts on the embedded policy (swarm/lora.py): options refused with the option named,
the adapter as the published state, the base hash, checkpoints and their resumption, a sampler's
backend taking adapter versions without reloading its base (merged and not), PEFT's files, and the
vLLM backend's LoRA route (marked `gpu`: skipped where no CUDA device exists)."""

import copy

import pytest
import torch
from pydantic import ValidationError

from swarm.config import LearnerConfig

PEERS = ["/ip4/127.0.0.1/tcp/9/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ"]
TARGETS = ["q_proj", "v_proj", "up_proj"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# peft's wraps and loads here go through swarm.lora.peft_quietly: transformers 5's warning about the
# old checkpointing flag peft reads (once in every LoRA peer's log) fails the test that meets it
pytestmark = pytest.mark.filterwarnings("error:`is_gradient_checkpointing` is deprecated:FutureWarning")


@pytest.mark.parametrize("options, named", [
    ({"lora_r": -1}, "lora_r"),
    ({"lora_r": 8, "lora_alpha": 0}, "lora_alpha"),
    ({"lora_r": 8, "lora_dropout": 1.0}, "lora_dropout"),
    ({"lora_r": 8, "lora_target_modules": ["q_proj", "bad name"]}, "--lora-target-modules"),
    ({"lora_r": 8, "lora_target_modules": []}, "--lora-target-modules"),
    ({"lora_r": 8, "learning_rate": 3e-5}, "--lora-learning-rate"),
])
def test_bad_lora_options_are_refused_naming_the_option(options, named):
    with pytest.raises(ValidationError) as caught:
        LearnerConfig(peers=PEERS, **options)
    assert named in str(caught.value)


def test_a_lora_run_trains_at_its_own_learning_rate_and_full_runs_are_unchanged():
    full, lora = LearnerConfig(peers=PEERS), LearnerConfig(peers=PEERS, lora_r=8)
    assert full.effective_learning_rate == full.learning_rate and lora.effective_learning_rate == lora.lora_learning_rate
    assert lora.lora_learning_rate > full.learning_rate


def test_swarm_config_learner_shows_the_lora_defaults():
    from click.testing import CliRunner

    from swarm.cli import main

    out = CliRunner().invoke(main, ["config", "learner"])
    assert out.exit_code == 0, out.output
    for key in ("lora_r = 0", "lora_alpha = 16.0", "lora_dropout", "lora_target_modules", "lora_learning_rate"):
        assert key in out.output


@pytest.fixture
def lora_model():
    from swarm.lora import wrap_lora
    from swarm.model.loading import load_policy

    model, tokenizer = load_policy("embedded")
    return wrap_lora(model, r=4, alpha=8, target_modules=TARGETS), tokenizer


def trained(model, steps: int = 2):
    """The adapter after a few AdamW steps on an arbitrary loss (B leaves zero)."""
    from swarm.lora import trainable_parameters

    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    for i in range(steps):
        torch.manual_seed(i)
        model(input_ids=torch.randint(0, 40, (2, 6))).logits.logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def test_an_unknown_target_module_is_refused_naming_the_option_and_the_models_layers():
    from swarm.lora import wrap_lora
    from swarm.model.loading import load_policy

    model, _ = load_policy("embedded")
    with pytest.raises(ValueError, match=r"--lora-target-modules: qkv is no linear layer of this model; its linear layers are .*q_proj"):
        wrap_lora(model, r=4, alpha=8, target_modules=["q_proj", "qkv"])


def test_the_published_state_is_the_adapter_alone_and_the_base_hash_ignores_it(lora_model):
    from swarm.fabric.weights.delta import state_hash
    from swarm.lora import base_state, load_policy_state, policy_state, trainable_parameters
    from swarm.model.loading import load_policy

    model, _ = lora_model
    plain, _ = load_policy("embedded")
    before = state_hash(base_state(model))
    assert before == state_hash(base_state(plain)) == state_hash(base_state(plain.to(torch.bfloat16)))
    trained(model)
    state = policy_state(model)
    assert set(state) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert sum(t.numel() for t in state.values()) == sum(p.numel() for p in trainable_parameters(model)) < 0.1 * plain.num_parameters()
    assert state_hash(base_state(model)) == before  # the base is frozen
    with pytest.raises(RuntimeError, match="LoRA adapter, but the model holds none"):
        load_policy_state(plain, state)
    with pytest.raises(RuntimeError, match="does not fit this LoRA adapter"):
        load_policy_state(model, {k: v for k, v in list(state.items())[1:]})


def test_a_lora_checkpoint_resumes_the_adapter_and_optimizer_and_refuses_another_base(lora_model, tmp_path):
    from swarm.checkpoint import load_verified, save_checkpoint
    from swarm.fabric.weights.delta import state_hash
    from swarm.lora import base_state, is_lora, policy_state, trainable_parameters

    model, tokenizer = lora_model
    optimizer = trained(model)
    digest = state_hash(policy_state(model))
    path = save_checkpoint(tmp_path, model, tokenizer, optimizer, version=2, digest=digest,
                           config={"model": "embedded", "lora_r": 4}, base_hash=state_hash(base_state(model)))
    assert (path / "adapter_model.safetensors").is_file() and not (path / "model.safetensors").exists()

    def build(model, tokenizer):
        learner = type("Core", (), {})()
        learner.model = model
        learner.optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
        return learner

    checkpoint, learner, _ = load_verified(tmp_path, build)
    assert checkpoint.version == 2 and is_lora(learner.model)
    assert state_hash(policy_state(learner.model)) == digest
    assert len(learner.optimizer.state) == len(trainable_parameters(learner.model)) > 0
    assert all(p.requires_grad == (".lora_" in n) for n, p in learner.model.named_parameters())
    # the base recorded is not the one --model holds now: refused, naming both
    state_file = path / "state.json"
    state_file.write_text(state_file.read_text().replace(state_hash(base_state(model)), "0" * 64))
    warned = []
    with pytest.raises(FileNotFoundError):
        load_verified(tmp_path, build, warn=warned.append)
    assert "base model 0000000000000000" in warned[0] and "restore that base model" in warned[0]


@pytest.mark.parametrize("merged", [False, True])
def test_a_sampler_backend_swaps_adapter_versions_without_reloading_its_base(lora_model, merged):
    from swarm.fabric.weights.delta import state_hash
    from swarm.generation.transformers_backend import TransformersBackend
    from swarm.lora import adapter_spec, base_state, policy_state
    from swarm.model.loading import load_policy

    model, _ = lora_model
    base, tokenizer = load_policy("embedded")
    backend = TransformersBackend(base, tokenizer)
    spec = adapter_spec(model, state_hash(base_state(model)))
    assert backend.base_hash() == spec.base_hash
    backend.use_adapter(spec, merged=merged)
    base_weight = backend.model.get_base_model().model.embed_tokens.weight
    ids = torch.tensor([[3, 14, 15, 9, 26]])
    for step in range(2):
        trained(model, steps=1)
        backend.load_state_dict(policy_state(model, copy=True))
        expected = copy.deepcopy(model).merge_and_unload()(input_ids=ids).logits
        with torch.no_grad():
            assert torch.allclose(backend.model(input_ids=ids).logits, expected, atol=1e-5)
    assert backend.model.get_base_model().model.embed_tokens.weight is base_weight  # the same base, never reloaded
    assert backend.base_hash() == spec.base_hash or merged  # merged: the adapter lives inside the base weights


def test_an_adapter_version_is_written_in_the_format_peft_reads_back(lora_model, tmp_path):
    from peft import PeftModel

    from swarm.fabric.weights.delta import state_hash
    from swarm.lora import adapter_files, adapter_spec, base_state, peft_quietly, policy_state
    from swarm.model.loading import load_policy

    model, _ = lora_model
    trained(model)
    spec = adapter_spec(model, state_hash(base_state(model)))
    path = adapter_files(policy_state(model), spec, tmp_path / "adapter")
    base, _ = load_policy("embedded")
    with peft_quietly():
        loaded = PeftModel.from_pretrained(base, str(path))
    ids = torch.tensor([[7, 1, 22]])
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6)


@pytest.mark.gpu
@needs_cuda
def test_vllm_generates_with_each_adapter_version_through_its_lora_api(lora_model):
    """vLLM's LoRA route: the engine built with enable_lora, each version an adapter directory and a
    new LoRARequest; greedy completions follow the adapter (a changed adapter changes them) and
    the base weights are never sent."""
    pytest.importorskip("vllm")
    from swarm.fabric.weights.delta import state_hash
    from swarm.generation import SamplingParams, make_backend
    from swarm.lora import adapter_spec, base_state, policy_state
    from swarm.model.loading import resolve_model_dir

    model, tokenizer = lora_model
    engine = make_backend("vllm", resolve_model_dir("embedded"), dtype="bfloat16", gpu_memory_utilization=0.3, max_lora_rank=4)
    spec = adapter_spec(model, state_hash(base_state(model)))
    assert engine.base_hash() == spec.base_hash  # a bfloat16 engine holds the same base
    engine.use_adapter(spec)
    assert not engine.partial_updates
    prompt = ["What is 12 + 7?"]
    greedy = SamplingParams(num_completions=1, temperature=0, max_new_tokens=12)
    engine.load_state_dict(policy_state(model, copy=True))  # B = 0: the base model's completions
    first = engine.generate(prompt, greedy)[0].completion_ids[0]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5)
    engine.load_state_dict(policy_state(model, copy=True))
    request = engine.lora_request
    second = engine.generate(prompt, greedy)[0]
    assert request.lora_int_id == 2 and second.completion_ids[0] != first
    # its log-probs are the adapted model's (the learner's recomputation)
    from swarm.logprobs import completion_logprobs

    ids = torch.tensor([second.prompt_ids]), torch.tensor([second.completion_ids[0]])
    recomputed = completion_logprobs(model.eval(), ids[0], torch.ones_like(ids[0]), ids[1], torch.ones_like(ids[1]),
                                     temperature=1.0, top_k=0, top_p=1.0)
    assert recomputed.shape[1] == len(second.completion_logprobs[0])


def test_the_vllm_engine_rank_is_one_vllm_accepts():
    from swarm.generation.vllm_backend import engine_lora_rank

    assert [engine_lora_rank(r) for r in (1, 4, 8, 9, 16, 300, 512)] == [8, 8, 8, 16, 16, 320, 512]
    with pytest.raises(ValueError, match="up to rank 512"):
        engine_lora_rank(1024)


def test_swarm_eval_lora_r_evaluates_a_lora_checkpoint_of_that_rank_and_refuses_anything_else(lora_model, tmp_path):
    """`swarm eval --lora-r R` evaluates a LoRA run's checkpoint (its adapter merged into the base its
    adapter_config.json names) and checks its rank; a base model is refused (a fresh adapter is the
    base itself), and a learner's run directory is answered with its newest checkpoint's path."""
    import json

    from click.testing import CliRunner

    from swarm.checkpoint import save_checkpoint
    from swarm.cli import main
    from swarm.fabric.weights.delta import state_hash
    from swarm.lora import base_state, policy_state

    model, tokenizer = lora_model
    optimizer = trained(model)
    path = save_checkpoint(tmp_path, model, tokenizer, optimizer, version=2, digest=state_hash(policy_state(model)),
                           config={"model": "embedded", "lora_r": 4}, base_hash=state_hash(base_state(model)))
    runner = CliRunner()
    quick = ["--eval-problems", "2", "--eval-samples", "1", "--max-completion-length", "8", "--no-greedy"]

    def refused(*args) -> str:
        out = runner.invoke(main, ["eval", *args, *quick])
        assert out.exit_code == 2, out.output
        return " ".join(out.output.split())  # click wraps long lines

    assert "LoRA run of rank 4; pass --lora-r 4" in refused("--model", str(path), "--lora-r", "8")
    assert "is no LoRA checkpoint" in refused("--model", "embedded", "--lora-r", "4")
    assert f"pass its newest checkpoint, --model {path}" in refused("--model", str(tmp_path), "--lora-r", "4")
    out = runner.invoke(main, ["eval", "--model", str(path), "--lora-r", "4", *quick, "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout[out.stdout.index("{"):])
    assert result["num_problems"] == 2 and result["model"] == str(path)


def test_gradient_checkpointing_gives_a_lora_run_the_same_gradients(lora_model):
    """PEFT with a frozen embedding: reentrant checkpointing would pass no gradient to the adapters
    (the checkpointed blocks' inputs need none); LearnerCore's non-reentrant checkpointing gives
    the adapter the gradients it has without checkpointing."""
    from swarm.lora import trainable_parameters
    from swarm.rollouts import RolloutGroup
    from swarm.training import LearnerCore

    model, tokenizer = lora_model
    trained(model)  # B away from zero: A's gradient is B's transpose times the rest
    grads = {}
    for checkpointing in (False, True):
        copy_ = copy.deepcopy(model)
        core = LearnerCore(copy_, tokenizer.pad_token_id, learning_rate=1e-3, lr_warmup_steps=0,
                           gradient_checkpointing=checkpointing)
        core.optimizer.step = lambda: None  # the gradients are compared, not the step
        core.step([RolloutGroup(problem_id="p", prompt_ids=[5, 9, 14, 3], completion_ids=[[7, 21, 4], [30, 2, 11, 6]],
                                sampler_logprobs=[[-2.0] * 3, [-2.0] * 4], rewards=[1.0, 0.0], version=0, sampler_id="t")])
        grads[checkpointing] = [p.grad for p in trainable_parameters(copy_)]
    assert len(grads[True]) == len(grads[False]) > 0 and all(g is not None for g in grads[True])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads[False], grads[True]))
    assert any(float(g.abs().max()) > 0 for g in grads[True])
