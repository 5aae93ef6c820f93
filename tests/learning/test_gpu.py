"""GPU paths (marked `gpu`, skipped where no CUDA device exists; never run by this project yet: no
GPU machine was lent to its work): a vLLM sampler against a GPU learner in bfloat16, in-place
partial weight updates checked against the engine, and the learner's view of the log-prob gap.

The vLLM backend's parts that need no vLLM (weights packed for `collective_rpc`, the worker-side
methods, the update check over tensor-parallel ranks) run on CPU here too, against a stand-in
worker and engine."""

import copy
import logging

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("vllm")
    from swarm.generation import make_backend
    from swarm.model.loading import resolve_model_dir

    return make_backend("vllm", resolve_model_dir("embedded"), dtype="bfloat16", gpu_memory_utilization=0.3)


def sampled_groups(backend, version: int, count: int = 4):
    from swarm.generation import SamplingParams
    from swarm.rewards import RewardScorer
    from swarm.sampling import produce_rollouts
    from swarm.tasks.synthetic import ArithmeticTask

    scorer = RewardScorer()
    try:
        problems = ArithmeticTask(2).problems("train")[:count]
        groups = produce_rollouts(backend, scorer, problems, SamplingParams(num_completions=8, max_new_tokens=16, seed=version),
                                  version=version, sampler_id="gpu")
    finally:
        scorer.close()
    for g in groups:  # an advantage in every group, whatever the policy answered
        g.rewards = [1.0, 0.0] * 4
    return groups


@pytest.mark.gpu
@needs_cuda
def test_vllm_sampler_against_a_bfloat16_gpu_learner(engine, caplog):
    """The learner (float32 master weights, bfloat16 autocast) steps on the engine's groups, publishes
    bfloat16, the engine takes only the changed tensors in place and is checked (no fallback to a
    whole reload); groups sampled after the swap agree with the learner's log-probs (its fresh gap
    stays under the alarm)."""
    from peers.sampler import load_version
    from swarm.fabric.weights.versions import VersionStore
    from swarm.model.loading import load_policy
    from swarm.training import LearnerCore

    model, tokenizer = load_policy("embedded", device="cuda", dtype="float32")
    core = LearnerCore(model, tokenizer.pad_token_id, autocast_dtype=torch.bfloat16, learning_rate=1e-3, lr_warmup_steps=0)
    store = VersionStore()

    def publish() -> None:
        store.add(core.version, {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()})

    publish()
    engine.load_state_dict(store.states[0])
    for _ in range(2):
        metrics = core.step(sampled_groups(engine, core.version))
        assert metrics["fresh_logprob_gap"] < 0.05, metrics["fresh_logprob_gap"]
        publish()
        with caplog.at_level(logging.WARNING, logger="peers.sampler"):
            load_version(engine, store.states[core.version], store.states[core.version - 1])  # raises if it did not take
        assert "loading the whole version again" not in caplog.text  # the partial update passed its check


@pytest.mark.gpu
@needs_cuda
def test_a_partial_update_that_does_not_take_is_caught(engine):
    from swarm.generation import SamplingParams
    from swarm.model.loading import load_policy

    model, _ = load_policy("embedded", dtype="bfloat16")
    held = {k: v.clone() for k, v in model.state_dict().items()}
    engine.load_state_dict(held)
    changed = {name: t + 0.01 for name, t in list(held.items())[:2]}
    wrong_previous = copy.deepcopy(held)
    for name in changed:  # claims the engine held something else before: the sums cannot match
        wrong_previous[name] = wrong_previous[name] - 1.0
    with pytest.raises(RuntimeError, match="did not take"):
        engine.load_state_dict(changed, previous=wrong_previous)
    # the same partial update with the truth about what the engine held passes its check
    engine.load_state_dict(held)
    engine.load_state_dict(changed, previous=held)
    # greedy with several completions (vLLM refuses n > 1 there): one completion, repeated
    gen = engine.generate(["Compute 3+4. Answer in \\boxed{}.\n"], SamplingParams(num_completions=3, temperature=0, max_new_tokens=8))[0]
    assert len(gen.completion_ids) == 3 and gen.completion_ids[0] == gen.completion_ids[2]
    assert len(gen.completion_logprobs[0]) == len(gen.completion_ids[0])


# --- the vLLM-free parts of the vLLM backend, on CPU -------------------------------------------------


class _TinyModel(torch.nn.Module):
    """Stands in for a vLLM model: `load_weights` copies checkpoint tensors into its parameters in
    place, taking any subset, and skips a tied output layer, as vLLM's models do."""

    def __init__(self, shard: slice | None = None):
        super().__init__()
        self.shard = shard  # this rank's rows of the sharded weight (tensor parallelism)
        rows = 4 if shard is None else shard.stop - shard.start
        self.embed = torch.nn.Parameter(torch.zeros(rows, 3, dtype=torch.bfloat16))
        self.norm = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))  # replicated on every rank

    def load_weights(self, weights):
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight":
                continue
            if name == "embed" and self.shard is not None:
                tensor = tensor[self.shard]
            getattr(self, name).data.copy_(tensor)
            loaded.add(name)
        return loaded


class _Worker:
    """A vLLM worker with the backend's extension mixed in, as `worker_extension_cls` does it."""

    def __init__(self, model):
        from types import SimpleNamespace

        from swarm.generation.vllm_backend import WeightSyncExtension

        self.__class__ = type("Worker", (_Worker, WeightSyncExtension), {})
        self.model_runner = SimpleNamespace(get_model=lambda: model)


class _Engine:
    """`LLM.collective_rpc` by method name over the workers (tensor-parallel ranks), as bytes
    reach them (a memoryview or bytes after msgpack), and `reset_prefix_cache`."""

    def __init__(self, workers):
        self.workers, self.calls = workers, []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert isinstance(method, str)  # a Python function would need VLLM_ALLOW_INSECURE_SERIALIZATION
        assert all(isinstance(a, bytes) for a in args)  # tensors would arrive as plain lists
        self.calls.append(method)
        return [getattr(w, method)(*args, **(kwargs or {})) for w in self.workers]

    def reset_prefix_cache(self):
        return True


def _backend(workers, tied=True, dtype=torch.bfloat16):
    from swarm.generation.vllm_backend import VLLMBackend

    backend = object.__new__(VLLMBackend)  # no vLLM here: the engine is a stand-in
    backend.llm, backend.tied, backend.dtype = _Engine(workers), tied, dtype
    return backend


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(4, 3, generator=g).to(torch.bfloat16)
    return {"embed": embed, "norm": torch.randn(3, generator=g).to(torch.bfloat16), "lm_head.weight": embed}


@pytest.mark.parametrize("ranks", [1, 2])
def test_weights_reach_the_workers_as_bytes_and_the_check_passes(ranks):
    from swarm.generation.vllm_backend import weight_payloads

    shards = [None] if ranks == 1 else [slice(0, 2), slice(2, 4)]
    models = [_TinyModel(s) for s in shards]
    backend = _backend([_Worker(m) for m in models])
    old, new = _state(0), _state(1)
    backend.load_state_dict(old)
    for m, s in zip(models, shards):
        assert torch.equal(m.embed, old["embed"] if s is None else old["embed"][s]) and torch.equal(m.norm, old["norm"])
    changed = {"norm": new["norm"]}  # a partial update: the replicated norm alone
    backend.load_state_dict(changed, previous=old)
    assert all(torch.equal(m.norm, new["norm"]) for m in models)
    backend.load_state_dict(new, previous={**old, "norm": new["norm"]})
    assert all(torch.equal(m.embed, new["embed"] if s is None else new["embed"][s]) for m, s in zip(models, shards))
    assert set(backend.llm.calls) == {"gepo_load_weights", "gepo_parameter_sums"}
    # packed in parts of at most `limit` bytes (one tensor per part here), tied lm_head left out
    assert len(list(weight_payloads(new, tied=True, limit=8))) == 2


def test_an_update_the_engine_did_not_take_is_caught_on_cpu():
    model = _TinyModel()
    backend = _backend([_Worker(model)])
    old, new = _state(0), _state(1)
    backend.load_state_dict(old)
    model.load_weights = lambda weights: set()  # the engine silently drops what it is given
    with pytest.raises(RuntimeError, match="did not take"):
        backend.load_state_dict({"norm": new["norm"]}, previous=old)


def test_expected_change_counts_in_the_engines_dtype():
    from swarm.generation.vllm_backend import expected_change

    old = {"w": torch.zeros(3)}
    new = {"w": torch.tensor([1.0 + 2 ** -10, 0.0, 0.0])}  # not a bfloat16 value: the engine rounds it to 1
    assert expected_change(old, new, tied=False, dtype=torch.bfloat16) == 1.0
    assert expected_change(old, new, tied=False) == 1.0 + 2 ** -10
