"""In-place weight updates of the vLLM backend (swarm/generation/vllm_backend.py), through the route
the installed vLLM gets (`update_route`: vLLM's weight-transfer API with the "ipc" backend from 0.25,
the worker extension before). The GPU tests (marked `gpu`) need CUDA and vllm and are skipped
elsewhere; never run by this project yet. The helpers that pick the route and complete a partial
update's modules run on CPU."""

import logging

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PROMPTS = ["Compute 3+4. Answer in \\boxed{}.\n", "Compute 12+30. Answer in \\boxed{}.\n"]


@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("vllm")
    from swarm.generation import make_backend
    from swarm.model.loading import resolve_model_dir

    # float32, as the learner recomputes: log-probs agree to 1e-3 (tests/learning/test_generation.py)
    return make_backend("vllm", resolve_model_dir("embedded"), dtype="float32", gpu_memory_utilization=0.25)


@pytest.fixture(scope="module")
def learner():
    from swarm.model.loading import load_policy

    model, _ = load_policy("embedded", device="cuda", dtype="float32")
    return model


def _cpu_state(model) -> dict:
    return {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}


def _perturbed(state: dict, seed: int, names=None, scale: float = 0.02) -> dict:
    """New values for `names` (default: all); the test model ties its output layer to the embedding,
    so a tied `lm_head.weight` follows the embedding rather than being drawn on its own."""
    g = torch.Generator().manual_seed(seed)
    names = [n for n in (list(state) if names is None else names) if n != "lm_head.weight"]
    out = {n: state[n] + scale * torch.randn(state[n].shape, generator=g, dtype=state[n].dtype) for n in names}
    if "lm_head.weight" in state and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _gap_to_learner(engine, learner, state: dict) -> float:
    """Largest |sampler - learner| log-prob over sampled tokens, the learner holding `state`."""
    from swarm.generation import SamplingParams
    from swarm.logprobs import completion_logprobs

    learner.load_state_dict({k: v.to("cuda") for k, v in state.items()}, strict=True)
    gens = engine.generate(PROMPTS, SamplingParams(num_completions=4, max_new_tokens=16, seed=3))
    prompts = [g.prompt_ids for g in gens for _ in g.completion_ids]
    completions = [c for g in gens for c in g.completion_ids]
    sampler_lp = [lp for g in gens for lp in g.completion_logprobs]
    pad = engine.tokenizer.pad_token_id
    tp, tc = max(map(len, prompts)), max(map(len, completions))
    p_ids = torch.tensor([[pad] * (tp - len(p)) + p for p in prompts]).cuda()
    p_mask = torch.tensor([[0] * (tp - len(p)) + [1] * len(p) for p in prompts]).cuda()
    c_ids = torch.tensor([c + [pad] * (tc - len(c)) for c in completions]).cuda()
    c_mask = torch.tensor([[1] * len(c) + [0] * (tc - len(c)) for c in completions]).cuda()
    s_lp = torch.tensor([lp + [0.0] * (tc - len(lp)) for lp in sampler_lp]).cuda()
    with torch.no_grad():
        lp = completion_logprobs(learner, p_ids, p_mask, c_ids, c_mask, temperature=1.0)
    return ((lp - s_lp).abs() * c_mask).max().item()


@pytest.mark.gpu
@needs_cuda
def test_an_in_place_update_samples_under_the_new_weights(engine, learner):
    """After an in-place update (checked against the engine), the engine's log-probs are the
    learner's under the new weights, and not under the old ones."""
    held = _cpu_state(learner)
    engine.load_state_dict(held)
    assert _gap_to_learner(engine, learner, held) <= 1e-3
    new = {**held, **_perturbed(held, seed=1)}
    engine.load_state_dict(new, previous=held)  # raises if the engine did not take exactly `new`
    assert _gap_to_learner(engine, learner, new) <= 1e-3
    assert _gap_to_learner(engine, learner, held) > 1e-2  # the old weights no longer explain them


@pytest.mark.gpu
@needs_cuda
def test_a_partial_update_takes_only_the_changed_tensors(engine, learner):
    """Only some tensors change (one projection of a fused attention block, one norm): the update
    carries those (on the IPC route with the rest of their modules from the held version), passes its
    check, and the engine then matches the learner."""
    held = _cpu_state(learner)
    engine.load_state_dict(held)
    names = [n for n in held if n.endswith("self_attn.q_proj.weight")][:1] + \
            [n for n in held if n.endswith("post_attention_layernorm.weight")][:1]
    assert len(names) == 2, list(held)[:8]
    changed = _perturbed(held, seed=2, names=names)
    engine.load_state_dict(changed, previous=held)
    assert _gap_to_learner(engine, learner, {**held, **changed}) <= 1e-3


@pytest.mark.gpu
@needs_cuda
def test_a_tensor_corrupted_on_the_way_fails_the_check_and_the_whole_version_is_reloaded(engine, learner, monkeypatch, caplog):
    """One tensor is altered between the sampler and the engine (on the first send only): the
    exact-weights check refuses the update, the sampler loads the whole version again, and the engine
    then holds exactly the published weights."""
    from peers.sampler import load_version
    from swarm.generation import vllm_backend

    held = _cpu_state(learner)
    engine.load_state_dict(held)
    new = {**held, **_perturbed(held, seed=3)}
    real_chunks, sends = vllm_backend.weight_chunks, []

    def corrupting_chunks(state_dict, **kwargs):
        first = not sends
        sends.append(1)
        for part in real_chunks(state_dict, **kwargs):
            if first and part:
                name = next(iter(part))
                part = {**part, name: part[name] + 0.5}
                first = False
            yield part

    monkeypatch.setattr(vllm_backend, "weight_chunks", corrupting_chunks)
    with pytest.raises(RuntimeError, match="did not take"):
        engine.load_state_dict(new, previous=held)
    sends.clear()
    with caplog.at_level(logging.WARNING, logger="peers.sampler"):
        load_version(engine, new, held)  # the partial update is corrupted again, then reloaded whole
    assert "loading the whole version again" in caplog.text
    monkeypatch.setattr(vllm_backend, "weight_chunks", real_chunks)
    assert _gap_to_learner(engine, learner, new) <= 1e-3
    engine.load_state_dict(held)  # and the check passes again on a clean update from there
    engine.load_state_dict(new, previous=held)


# --- the route and the modules a partial update carries, on CPU ----------------------------------


def test_the_route_follows_the_vllm_version():
    from packaging.version import Version

    from swarm.generation.vllm_backend import ROUTE_EXTENSION, ROUTE_WEIGHT_TRANSFER, update_route

    assert update_route(Version("0.10.2"), {}) == ROUTE_EXTENSION
    assert update_route(Version("0.22.0"), {}) == ROUTE_EXTENSION  # the API changed shape until 0.25
    assert update_route(Version("0.25.0"), {}) == ROUTE_WEIGHT_TRANSFER
    assert update_route(Version("0.33.0"), {}) == ROUTE_WEIGHT_TRANSFER
    assert update_route(None, {}) == ROUTE_WEIGHT_TRANSFER  # an unparsable dev build: a current one
    # IPC handles need pickling through collective_rpc: a user who forbids it keeps the extension
    assert update_route(Version("0.33.0"), {"VLLM_ALLOW_INSECURE_SERIALIZATION": "0"}) == ROUTE_EXTENSION
    assert update_route(Version("0.33.0"), {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}) == ROUTE_WEIGHT_TRANSFER


def test_a_partial_update_carries_whole_modules():
    from swarm.generation.vllm_backend import complete_modules, expected_change, module_of

    assert module_of("model.layers.3.self_attn.q_proj.weight") == "model.layers.3.self_attn"
    assert module_of("model.layers.3.mlp.gate_proj.weight") == "model.layers.3.mlp"
    assert module_of("model.layers.3.input_layernorm.weight") == "model.layers.3.input_layernorm"
    assert module_of("model.embed_tokens.weight") == "model.embed_tokens"
    previous = {name: torch.full((2,), float(i)) for i, name in enumerate([
        "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight"])}
    changed = {"model.layers.0.self_attn.k_proj.weight": torch.full((2,), 9.0)}
    sent = complete_modules(changed, previous)
    assert set(sent) == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                         "model.layers.0.self_attn.v_proj.weight"}
    assert torch.equal(sent["model.layers.0.self_attn.k_proj.weight"], changed["model.layers.0.self_attn.k_proj.weight"])
    # the siblings carried along are what the engine holds: the check expects them not to move
    assert expected_change(previous, sent, tied=False) == expected_change(previous, changed, tied=False)
