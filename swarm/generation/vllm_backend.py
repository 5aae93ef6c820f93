"""Generation with vLLM on GPUs (the optional `vllm` extra; imported only when this backend is
chosen). New policy versions are loaded into the running engine in place, without a restart.

Checked against vLLM's released sources 0.10.0, 0.10.1.1, 0.10.2, 0.11.0, 0.11.2 and 0.33.0 (V1
engine; in 0.33 also its default "model runner V2"); not yet run on a GPU by this project.

Log-probs: vLLM reports raw-model log-probs by default; we start the engine with
`logprobs_mode="processed_logprobs"` so the recorded value is under the distribution actually
sampled from (temperature, top-k, top-p applied), the same one `swarm.logprobs` recomputes. That
holds from vLLM 0.10.2 on (vllm/v1/sample/ops/topk_topp_sampler.py returns the log-probs after
top-k/top-p there); 0.10.0 and 0.10.1 take "processed" before temperature and top-k/top-p
(vllm/v1/sample/sampler.py), so with those versions only temperature 1 (or greedy) without top-k
or top-p is accepted.

Weight updates: the engine core runs in its own process (V1's default), and `LLM.collective_rpc`
reaches it over ZMQ with msgpack (vllm/v1/serial_utils.py, MsgpackEncoder/MsgpackDecoder; the
engine core decodes utility calls with an untyped decoder, vllm/v1/engine/core.py). A Python
function is refused there unless VLLM_ALLOW_INSECURE_SERIALIZATION=1 (it is then pickled), and a
torch.Tensor argument arrives as a plain [dtype, shape, buffer-index] list, not a tensor, in every
version checked. So the weights travel as bytes (torch.save of a name -> tensor dict, loaded on the
worker with weights_only=True) to methods that `worker_extension_cls` mixes into every worker (the
mechanism of vllm/worker/worker_base.py `WorkerWrapperBase.init_worker` in 0.10/0.11,
vllm/v1/worker/worker_base.py in 0.33; vLLM's RLHF examples use it the same way), called by name.
"""

from __future__ import annotations

import io
import math
from typing import Iterator, Mapping, Sequence

from swarm.generation.base import Generation, SamplingParams

# one collective_rpc call carries at most about this many bytes of tensors (msgpack's bin type,
# which carries them, stops at 4 GiB; a single larger tensor cannot be sent)
PAYLOAD_BYTES = 1 << 30
_SUM_CHUNK = 1 << 24  # elements cast to float64 at once when a parameter is summed


class WeightSyncExtension:
    """Mixed into each vLLM worker class (LLM(worker_extension_cls=...)); `self` is the worker
    (vllm.v1.worker.gpu_worker.Worker), whose `model_runner.get_model()` is the model without the
    CUDA-graph wrapper (0.11+ wrap it). Method names must not clash with the worker's own
    attributes (vLLM asserts so), hence the prefix; no other attributes are defined here."""

    def gepo_load_weights(self, payload: bytes) -> int:
        """Copy the tensors in `payload` (torch.save of {checkpoint name: tensor}) into the model.
        `model.load_weights` takes any subset of the checkpoint's tensors (fused and sharded
        parameters take their part in place: the weight loaders copy into the existing storage,
        so CUDA graphs stay valid). Returns how many tensors it was given."""
        import torch

        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        self.model_runner.get_model().load_weights(list(state.items()))
        return len(state)

    def gepo_parameter_sums(self) -> dict:
        """{parameter name: float64 sum of its elements} over the parameters this worker holds
        (a tensor-parallel rank holds its shards)."""
        import torch

        sums = {}
        with torch.no_grad():
            for name, p in self.model_runner.get_model().named_parameters():
                flat = p.detach().reshape(-1)
                total = torch.zeros((), dtype=torch.float64, device=flat.device)
                for chunk in flat.split(_SUM_CHUNK):
                    total += chunk.double().sum()
                sums[name] = float(total)
        return sums


EXTENSION = f"{WeightSyncExtension.__module__}.{WeightSyncExtension.__qualname__}"


def combine_rank_sums(per_rank: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One sum per parameter from every worker's sums. A parameter tensor parallelism replicates
    (norms, a row-parallel bias) has the same sum on every rank and counts once; a sharded one
    differs between ranks and its shards add up. (Shards whose float64 sums agree exactly count
    once: only constant tensors do that. Key/value heads replicated because the model has fewer
    of them than ranks make the check fail, and the caller reloads everything.)"""
    values: dict[str, list[float]] = {}
    for sums in per_rank:
        for name, value in sums.items():
            values.setdefault(name, []).append(float(value))
    return {name: vs[0] if all(v == vs[0] for v in vs) else math.fsum(vs) for name, vs in values.items()}


def tensor_sum(tensor, dtype=None) -> float:
    """float64 sum of a tensor's elements, after casting it to `dtype` (the engine's) if given."""
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return float(tensor.double().sum())


def expected_change(old: Mapping[str, "object"], new: Mapping[str, "object"], *, tied: bool, dtype=None) -> float:
    """sum(new) - sum(old) over the tensors in `new`, in float64, as the engine should see it: each
    tensor cast to the engine's `dtype` (what its parameters hold), a tied output layer being the
    embedding, held once."""
    total = 0.0
    for name, tensor in new.items():
        if tied and name == "lm_head.weight":
            continue
        before = old.get(name)
        total += tensor_sum(tensor, dtype) - (tensor_sum(before, dtype) if before is not None else 0.0)
    return total


def weight_payloads(state_dict: Mapping[str, "object"], *, tied: bool, limit: int = PAYLOAD_BYTES) -> Iterator[bytes]:
    """torch.save'd {name: CPU tensor} dicts of at most about `limit` bytes each (a tensor larger
    than `limit` goes alone). A tied `lm_head.weight` is left out: vLLM's models skip it."""
    import torch

    def saved(part: dict) -> bytes:
        buf = io.BytesIO()
        torch.save(part, buf)
        return buf.getvalue()

    part, size = {}, 0
    for name, tensor in state_dict.items():
        if tied and name == "lm_head.weight":
            continue
        t = tensor.detach().to("cpu")
        nbytes = t.numel() * t.element_size()
        if not t.is_contiguous() or t.untyped_storage().nbytes() != nbytes:
            t = t.contiguous().clone()  # torch.save writes a view's whole storage
        if part and size + nbytes > limit:
            yield saved(part)
            part, size = {}, 0
        part[name] = t
        size += nbytes
    if part:
        yield saved(part)


def _vllm_version():
    try:
        import vllm
        from packaging.version import Version

        return Version(vllm.__version__)
    except Exception:  # an unparsable dev build: assume a current one
        return None


def _processed_logprobs_mode():
    """"processed_logprobs" as the installed vLLM spells it: 0.10.2 alone made LogprobsMode an
    Enum, which its sampler compares against (vllm/config/__init__.py, v1/sample/sampler.py); the
    other versions checked use a Literal of strings."""
    import enum

    try:
        from vllm.config import LogprobsMode
    except ImportError:
        return "processed_logprobs"
    if isinstance(LogprobsMode, type) and issubclass(LogprobsMode, enum.Enum):
        return LogprobsMode("processed_logprobs")
    return "processed_logprobs"


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
        import torch

        version = _vllm_version()
        # 0.10.0/0.10.1 compute "processed" log-probs before temperature and top-k/top-p
        self.logprobs_after_top_k_top_p = version is None or version.release >= (0, 10, 2)
        self.llm = LLM(
            model=model_dir,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            seed=seed,
            enable_prefix_caching=True,
            logprobs_mode=_processed_logprobs_mode(),
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            worker_extension_cls=EXTENSION,
        )
        model_config = self.llm.llm_engine.model_config
        mode = getattr(model_config.logprobs_mode, "value", model_config.logprobs_mode)
        if mode != "processed_logprobs":
            raise RuntimeError(f"the vLLM engine records {mode!r} log-probs, not the processed ones asked for")
        self.tokenizer = self.llm.get_tokenizer()
        self.tied = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
        # a torch.dtype once the engine's config is resolved (ModelConfig.__post_init__)
        self.dtype = model_config.dtype if isinstance(model_config.dtype, torch.dtype) else None

    def load_state_dict(self, state_dict: Mapping[str, "object"], previous: Mapping[str, "object"] | None = None) -> None:
        """Load `state_dict` (all tensors, or only those that changed since `previous`) into the
        running engine. With `previous`, check that the engine really took it: a silent failure to
        update is a known bug of other trainers (TRL #5312). The parameters' float64 sums must move
        by exactly what the new tensors' sums say (in the engine's dtype; garbage in vocabulary
        padding cancels out, and vLLM zero-fills it anyway)."""
        before = self._parameter_sums() if previous is not None else None
        for payload in weight_payloads(state_dict, tied=self.tied):
            self.llm.collective_rpc("gepo_load_weights", args=(payload,))
        # cached KV blocks were computed by the old weights (0.10/0.11 return None, 0.33 a bool)
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM did not reset its prefix cache after a weight update (requests still running?)")
        if previous is None:
            return
        after = self._parameter_sums()
        # a parameter the update did not touch has bit-identical sums: only touched ones contribute
        moved = math.fsum(value - before.get(name, 0.0) for name, value in after.items())
        expected = expected_change(previous, state_dict, tied=self.tied, dtype=self.dtype)
        scale = sum(float(t.double().abs().sum()) for t in state_dict.values()) or 1.0
        if not abs(moved - expected) <= 1e-9 * scale + 1e-6:  # NaN fails too
            raise RuntimeError(f"the vLLM engine did not take the new weights: its parameters moved by {moved:.6g}, "
                               f"the update by {expected:.6g}")

    def _parameter_sums(self) -> dict[str, float]:
        # every tensor-parallel rank answers for the parameters (or shards) it holds
        return combine_rank_sums(self.llm.collective_rpc("gepo_parameter_sums"))

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[Generation]:
        from vllm import SamplingParams as VSamplingParams

        if not self.logprobs_after_top_k_top_p and not params.greedy and (
                params.temperature != 1.0 or params.top_k or params.top_p < 1.0):
            raise ValueError("vLLM before 0.10.2 records log-probs before temperature and top-k/top-p; with "
                             f"temperature {params.temperature:g}, top-k {params.top_k}, top-p {params.top_p:g} "
                             "they would not match the learner's: upgrade vllm (>= 0.10.2)")
        # vLLM refuses n > 1 with greedy decoding (SamplingParams._verify_greedy_sampling): greedy
        # completions are all the same, so one is asked for and repeated
        copies = params.num_completions if params.greedy else 1
        sp = VSamplingParams(
            n=params.num_completions // copies,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,  # 0 disables top-k (vLLM's default; -1 is only tolerated)
            max_tokens=params.max_new_tokens,
            seed=params.seed,  # with n > 1 each completion gets seed + its index (v1/engine/parallel_sampling.py)
            logprobs=0,  # the sampled token's own log-prob
            # stop at a stop string, keeping its tokens: the same completion truncate_at_stop makes
            stop=list(params.stop_strings) or None,
            include_stop_str_in_output=True,
        )
        outputs = self.llm.generate(list(prompts), sp, use_tqdm=False)  # in prompt order
        eos = self.tokenizer.eos_token_id
        gens = []
        for out in outputs:
            ids, lps, texts, finished = [], [], [], []
            for comp in out.outputs:
                toks = list(comp.token_ids)  # ends with EOS when the completion stopped on it
                ids.append(toks)
                # one {token id: Logprob} per position (a list, or 0.33's FlatLogprobs)
                lps.append([float(step[tok].logprob) for tok, step in zip(toks, comp.logprobs)])
                texts.append(self.tokenizer.decode(toks, skip_special_tokens=True))
                finished.append(bool(toks) and toks[-1] == eos)
            if copies > 1:
                ids, lps = [list(ids[0]) for _ in range(copies)], [list(lps[0]) for _ in range(copies)]
                texts, finished = texts * copies, finished * copies
            gens.append(Generation(list(out.prompt_token_ids), ids, lps, texts, finished))
        return gens
