"""Generation with vLLM on GPUs (the optional `vllm` extra; imported only when this backend is
chosen). New policy versions are loaded into the running engine in place, without a restart.

Log-probs: vLLM reports raw-model log-probs by default; we start the engine with
`logprobs_mode="processed_logprobs"` so the recorded value is under the distribution actually
sampled from (temperature, top-k, top-p applied), the same one `swarm.logprobs` recomputes.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from swarm.generation.base import Generation, SamplingParams


def _load_weights_on_worker(worker, items):
    """Runs inside each vLLM worker (through `collective_rpc`): copy tensors into the model."""
    worker.model_runner.model.load_weights(weights=items)


def _fingerprint_on_worker(worker) -> float:
    """The float64 sum of every parameter the worker's model holds (fused or sharded, the elements
    are the same as the checkpoint's, so sums of differences match)."""
    import torch

    with torch.no_grad():
        return float(sum(p.detach().double().sum() for p in worker.model_runner.model.parameters()))


def expected_change(old: Mapping[str, "object"], new: Mapping[str, "object"], *, tied: bool) -> float:
    """sum(new) - sum(old) over the tensors in `new`, in float64, as the engine should see it (a
    tied output layer is the embedding, held once)."""
    total = 0.0
    for name, tensor in new.items():
        if tied and name == "lm_head.weight":
            continue
        before = old.get(name)
        total += float(tensor.double().sum()) - (float(before.double().sum()) if before is not None else 0.0)
    return total


class VLLMBackend:
    name = "vllm"

    partial_updates = True  # load_weights takes any subset of the tensors

    def __init__(self, model_dir: str, *, dtype: str = "bfloat16", gpu_memory_utilization: float = 0.85,
                 max_model_len: int | None = None, tensor_parallel_size: int = 1, enforce_eager: bool = False,
                 seed: int = 0) -> None:
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ImportError(
                "the vllm backend needs the optional extra: pip install 'gepo-swarm[vllm]' (GPU machines only)"
            ) from exc
        self.llm = LLM(
            model=model_dir,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            seed=seed,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.tied = bool(getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))

    def load_state_dict(self, state_dict: Mapping[str, "object"], previous: Mapping[str, "object"] | None = None) -> None:
        """Load `state_dict` (all tensors, or only those that changed since `previous`) into the
        running engine. With `previous`, check that the engine really took it: a silent failure to
        update is a known bug of other trainers (TRL #5312). The parameters' float64 sum must move
        by exactly what the new tensors' sums say (garbage in vocabulary padding cancels out)."""
        before = self._fingerprint() if previous is not None else None
        self.llm.collective_rpc(_load_weights_on_worker, args=(list(state_dict.items()),))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        if previous is None:
            return
        moved = self._fingerprint() - before
        expected = expected_change(previous, state_dict, tied=self.tied)
        scale = sum(float(t.double().abs().sum()) for t in state_dict.values()) or 1.0
        if abs(moved - expected) > 1e-9 * scale + 1e-6:
            raise RuntimeError(f"the vLLM engine did not take the new weights: its parameters moved by {moved:.6g}, "
                               f"the update by {expected:.6g}")

    def _fingerprint(self) -> float:
        # every tensor-parallel rank holds its own shard: the model's sum is the sum of theirs
        return sum(self.llm.collective_rpc(_fingerprint_on_worker))

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[Generation]:
        from vllm import SamplingParams as VSamplingParams

        sp = VSamplingParams(
            n=params.num_completions,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_new_tokens,
            seed=params.seed,
            logprobs=0,  # the sampled token's own log-prob
            # stop at a stop string, keeping its tokens: the same completion truncate_at_stop makes
            stop=list(params.stop_strings) or None,
            include_stop_str_in_output=True,
        )
        outputs = self.llm.generate(list(prompts), sp, use_tqdm=False)
        eos = self.tokenizer.eos_token_id
        gens = []
        for out in outputs:
            ids, lps, texts, finished = [], [], [], []
            for comp in out.outputs:
                toks = list(comp.token_ids)
                ids.append(toks)
                lps.append([float(step[tok].logprob) for tok, step in zip(toks, comp.logprobs)])
                texts.append(self.tokenizer.decode(toks, skip_special_tokens=True))
                finished.append(bool(toks) and toks[-1] == eos)
            gens.append(Generation(list(out.prompt_token_ids), ids, lps, texts, finished))
        return gens
