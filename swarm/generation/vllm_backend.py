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


class VLLMBackend:
    name = "vllm"

    def __init__(self, model_dir: str, *, dtype: str = "bfloat16", gpu_memory_utilization: float = 0.85,
                 max_model_len: int | None = None, seed: int = 0) -> None:
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
        )
        self.tokenizer = self.llm.get_tokenizer()

    def load_state_dict(self, state_dict: Mapping[str, "object"]) -> None:
        items = list(state_dict.items())
        self.llm.collective_rpc(_load_weights_on_worker, args=(items,))
        # cached KV blocks were computed by the old weights
        self.llm.reset_prefix_cache()

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
