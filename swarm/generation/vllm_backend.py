"""Generation with vLLM on GPUs (the optional `vllm` extra; imported only when this backend is
chosen). New policy versions are loaded into the running engine in place, without a restart.

Checked against vLLM's released sources 0.10.0, 0.10.1.1, 0.10.2, 0.11.0, 0.11.2 and 0.33.0 (V1
engine; in 0.33 also its default "model runner V2"); the weight-update routes also against 0.12 to
0.18, 0.20, 0.22, 0.25, 0.28 and 0.30. Not yet run on a GPU by this project.

Log-probs: vLLM reports raw-model log-probs by default; we start the engine with
`logprobs_mode="processed_logprobs"` so the recorded value is under the distribution actually
sampled from (temperature, top-k, top-p applied), the same one `swarm.logprobs` recomputes. That
holds from vLLM 0.10.2 on (vllm/v1/sample/ops/topk_topp_sampler.py returns the log-probs after
top-k/top-p there); 0.10.0 and 0.10.1 take "processed" before temperature and top-k/top-p
(vllm/v1/sample/sampler.py), so with those versions only temperature 1 (or greedy) without top-k
or top-p is accepted.

Weight updates take one of two routes, picked by the installed version (`update_route`):

- vLLM 0.25 and later: vLLM's own RL weight-sync API, the route its documentation
  (docs/training/weight_transfer/) and examples (examples/rl/rlhf_ipc.py, colocated training and
  inference on one GPU) describe and its tests exercise (tests/distributed/test_weight_transfer.py,
  and the LLM-class API tests with a stand-in engine): the engine is built with
  `weight_transfer_config=WeightTransferConfig(backend="ipc")`, and each update is
  `LLM.start_weight_update()`, one `LLM.update_weights({"update_info": ...})` per chunk,
  `LLM.finish_weight_update()` (vllm/entrypoints/llm.py in 0.25-0.30, vllm/entrypoints/rl/offline.py
  in 0.33; worker side vllm/v1/worker/gpu_worker.py, backend
  vllm/distributed/weight_transfer/ipc_engine.py). The "ipc" backend takes CUDA IPC handles of
  tensors on the workers' GPUs, so each chunk is staged there from this process. Its handles are
  pickled through `collective_rpc`, which vLLM refuses unless VLLM_ALLOW_INSECURE_SERIALIZATION=1
  (vllm/v1/serial_utils.py; the example sets it the same way): this backend sets it when it is
  unset, and uses the older route below when it is set to 0. The API first appeared in 0.16 and
  changed shape until 0.25 (0.16: NCCL only; 0.17-0.20: handles as (function, args) and
  `is_checkpoint_format` per update; 0.22: `start_weight_update(is_checkpoint_format)`); from 0.25
  to 0.33 the unpacked IPC form used here is the same. The IPC backend reloads layer by layer
  (vllm/model_executor/model_loader/reload/layerwise.py): a layer given only some of its tensors is
  rebuilt from those alone, so a partial update sends every tensor of each touched module
  (`complete_modules`), the unchanged ones from the version the engine holds.
- vLLM 0.10.2 to 0.24: methods that `worker_extension_cls` mixes into every worker, called by name
  with `LLM.collective_rpc`: the route vLLM's RLHF examples documented before its weight-transfer
  API (examples/offline_inference/rlhf.py, rlhf_colocate.py, rlhf_utils.py; mechanism in
  vllm/worker/worker_base.py `WorkerWrapperBase.init_worker` in 0.10/0.11,
  vllm/v1/worker/worker_base.py later). `collective_rpc` reaches the engine core over ZMQ with
  msgpack (vllm/v1/serial_utils.py); a torch.Tensor argument arrives as a plain list there, so the
  weights travel as bytes (torch.save of a name -> tensor dict, loaded on the worker with
  weights_only=True).

LoRA runs (swarm/lora.py) take neither route: the engine is built with `enable_lora=True`,
`max_lora_rank` (the sampler's --max-lora-rank) and `max_loras=1` (EngineArgs, vllm/engine/arg_utils.py;
LoRAConfig, vllm/config/lora.py), and each version is written as a PEFT adapter directory
(adapter_config.json, adapter_model.safetensors: what vllm/lora/peft_helper.py and
vllm/lora/models.py `from_local_checkpoint` read) and handed to every `LLM.generate` call as
`lora_request=LoRARequest(name, int_id, path)` (vllm/lora/request.py; the offline example
examples/offline_inference/multilora_inference.py). vLLM caches adapters by `lora_int_id`, so each
version gets a new id, and the least recently used one is evicted; the base weights are never
reloaded. Checked against vLLM 0.10.2-0.11 and 0.33's sources (same LoRARequest fields and LLM
arguments); not yet run on a GPU by this project.

On both full-weight routes the update is checked (`VLLMBackend.load_state_dict`): every parameter's float64 sum,
read from every worker, must move by exactly what the published tensors say; a caller that sees
the check fail loads the whole version again (peers/sampler.py `load_version`).
"""

from __future__ import annotations

import io
import logging
import math
import os
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from swarm.generation.base import Generation, SamplingParams
from swarm.fabric.weights.delta import state_hash
from swarm.lora import AdapterSpec, adapter_files, base_state
from swarm.model.loading import load_policy

logger = logging.getLogger(__name__)

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
        return worker_parameter_sums(self)


def worker_parameter_sums(worker) -> dict:
    """{parameter name: float64 sum of its elements} over the parameters `worker` (a vLLM worker)
    holds. Sent by reference to the workers on the weight-transfer route (`LLM.collective_rpc` takes
    a function whose first argument is the worker: vllm/entrypoints/llm.py, vllm/v1/serial_utils.py
    `run_method`); called by the extension's method on the other."""
    import torch

    sums = {}
    with torch.no_grad():
        for name, p in worker.model_runner.get_model().named_parameters():
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


def weight_chunks(state_dict: Mapping[str, "object"], *, tied: bool,
                  limit: int = PAYLOAD_BYTES) -> Iterator[dict]:
    """{name: contiguous CPU tensor} dicts of at most about `limit` bytes each (a tensor larger than
    `limit` goes alone). A tied `lm_head.weight` is left out: vLLM's models skip it (and published
    versions do not carry it: swarm/tied_weights.py; the engine ties it to the embedding itself)."""
    part, size = {}, 0
    for name, tensor in state_dict.items():
        if tied and name == "lm_head.weight":
            continue
        t = tensor.detach().to("cpu")
        nbytes = t.numel() * t.element_size()
        if not t.is_contiguous() or t.untyped_storage().nbytes() != nbytes:
            t = t.contiguous().clone()  # torch.save writes a view's whole storage
        if part and size + nbytes > limit:
            yield part
            part, size = {}, 0
        part[name] = t
        size += nbytes
    if part:
        yield part


def weight_payloads(state_dict: Mapping[str, "object"], *, tied: bool, limit: int = PAYLOAD_BYTES) -> Iterator[bytes]:
    """torch.save'd `weight_chunks` (the worker-extension route's payloads)."""
    import torch

    for part in weight_chunks(state_dict, tied=tied, limit=limit):
        buf = io.BytesIO()
        torch.save(part, buf)
        yield buf.getvalue()


def module_of(name: str) -> str:
    """The module a checkpoint tensor belongs to, as wide as vLLM may fuse it: a decoder layer's
    attention or MLP block as a whole ("model.layers.3.self_attn.q_proj.weight" ->
    "model.layers.3.self_attn": q/k/v become one qkv_proj, gate/up one gate_up_proj), otherwise the
    tensor's own module."""
    parts = name.split(".")
    for i in range(len(parts) - 2):
        if parts[i] == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[: i + 3])
    return ".".join(parts[:-1]) or name


def complete_modules(changed: Mapping[str, "object"], previous: Mapping[str, "object"]) -> dict:
    """`changed` plus, from `previous`, every other tensor of each module it touches: vLLM's
    layer-by-layer reload rebuilds a layer from the tensors it is given, so it must get all of them.
    The added tensors are what the engine holds already (the update check sees them not move)."""
    touched = {module_of(name) for name in changed}
    out = dict(changed)
    for name, tensor in previous.items():
        if name not in out and module_of(name) in touched:
            out[name] = tensor
    return out


ROUTE_WEIGHT_TRANSFER = "weight_transfer"  # vLLM's RL weight-sync API, "ipc" backend (0.25+)
ROUTE_EXTENSION = "worker_extension"  # worker_extension_cls + collective_rpc by name (0.10.2-0.24)
WEIGHT_TRANSFER_SINCE = (0, 25)


def update_route(version, environ: Mapping[str, str] = os.environ) -> str:
    """Which way weights reach the engine for vLLM `version` (None: an unparsable dev build, taken
    as current). The weight-transfer route needs pickled IPC handles through collective_rpc: with
    VLLM_ALLOW_INSECURE_SERIALIZATION set to 0 by the user, the worker-extension route is used."""
    if version is not None and version.release < WEIGHT_TRANSFER_SINCE:
        return ROUTE_EXTENSION
    if environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION", "1").strip() in ("0", ""):
        return ROUTE_EXTENSION
    return ROUTE_WEIGHT_TRANSFER


# the ranks vLLM's engine accepts as max_lora_rank (vllm/config/lora.py MaxLoRARanks; 0.10-0.11
# list 8 to 512, later ones add 1)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def engine_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as max_lora_rank that holds adapters of `rank`."""
    fitting = [r for r in VLLM_LORA_RANKS if r >= max(rank, 8)]
    if not fitting:
        raise ValueError(f"--max-lora-rank {rank}: vLLM serves LoRA adapters up to rank {VLLM_LORA_RANKS[-1]}")
    return fitting[0]


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

    adapter: AdapterSpec | None = None  # a LoRA run's adapter (`use_adapter`)
    lora_request = None  # the LoRARequest of the version held, in a LoRA run

    @property
    def partial_updates(self) -> bool:
        """The engine takes any subset of the tensors (whole modules on the IPC route); an adapter is written whole."""
        return self.adapter is None
    route = ROUTE_EXTENSION  # set per engine in __init__ (`update_route`)
    tensor_parallel_size = 1

    def __init__(self, model_dir: str, *, dtype: str = "bfloat16", gpu_memory_utilization: float = 0.85,
                 max_model_len: int | None = None, tensor_parallel_size: int = 1, enforce_eager: bool = False,
                 seed: int = 0, max_lora_rank: int = 0) -> None:
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
        self.route = update_route(version)
        self.tensor_parallel_size = tensor_parallel_size
        if self.route == ROUTE_WEIGHT_TRANSFER:
            from vllm.config import WeightTransferConfig

            # read by the engine core's process when it starts (vllm/envs.py): IPC handles are
            # pickled through collective_rpc, as in vLLM's examples/rl/rlhf_ipc.py
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
            update_args = {"weight_transfer_config": WeightTransferConfig(backend="ipc")}
        else:
            update_args = {"worker_extension_cls": EXTENSION}
        self.model_dir, self.max_lora_rank, self._lora_ids = model_dir, max_lora_rank, 0
        if max_lora_rank:  # LoRA runs' adapters, one at a time (each version is one)
            update_args.update(enable_lora=True, max_lora_rank=engine_lora_rank(max_lora_rank), max_loras=1)
        logger.info("vLLM %s: weights are updated through %s", version or "(dev build)", self.route)
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
            **update_args,
        )
        if self.route == ROUTE_WEIGHT_TRANSFER:
            # the IPC backend needs no rendezvous; its init info is empty (packed=False, unpacked
            # handles: the form 0.25-0.33 share)
            self.llm.init_weight_transfer_engine({"init_info": {}})
        model_config = self.llm.llm_engine.model_config
        mode = getattr(model_config.logprobs_mode, "value", model_config.logprobs_mode)
        if mode != "processed_logprobs":
            raise RuntimeError(f"the vLLM engine records {mode!r} log-probs, not the processed ones asked for")
        self.tokenizer = self.llm.get_tokenizer()
        self.tied = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
        # a torch.dtype once the engine's config is resolved (ModelConfig.__post_init__)
        self.dtype = model_config.dtype if isinstance(model_config.dtype, torch.dtype) else None

    def base_hash(self) -> str:
        """The hash of the base model in `model_dir` (swarm.lora.base_state), read once on the CPU in
        bfloat16: vLLM's own copy is on the GPU, under its own (fused) names."""
        model, _ = load_policy(self.model_dir, dtype="bfloat16")
        try:
            return state_hash(base_state(model))
        finally:
            del model

    def use_adapter(self, spec: AdapterSpec) -> None:
        """Serve a LoRA run: each version from now on is an adapter (`load_state_dict` writes it out)."""
        import tempfile

        if not self.max_lora_rank:
            raise ValueError(f"the run trains {spec.describe()}, but this vLLM engine was built without LoRA: restart "
                             f"the sampler with --max-lora-rank {spec.r} (or more)")
        if spec.r > self.max_lora_rank:
            raise ValueError(f"the run's LoRA rank {spec.r} exceeds this engine's --max-lora-rank {self.max_lora_rank}: "
                             f"restart the sampler with --max-lora-rank {spec.r}")
        self.adapter, self.adapter_root = spec, Path(tempfile.mkdtemp(prefix="gepo-lora-"))

    def _load_adapter(self, state_dict: Mapping[str, "object"]) -> None:
        """A LoRA version: its adapter directory, and a new id (vLLM caches adapters by id)."""
        import shutil

        from vllm.lora.request import LoRARequest

        self._lora_ids += 1
        path = adapter_files(state_dict, self.adapter, self.adapter_root / f"adapter-{self._lora_ids}", base_model=self.model_dir)
        old, self.lora_request = self.lora_request, LoRARequest(f"gepo-{self._lora_ids}", self._lora_ids, str(path))
        if old is not None:  # vLLM read it when first used; a new id never reads it again
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def load_state_dict(self, state_dict: Mapping[str, "object"], previous: Mapping[str, "object"] | None = None) -> None:
        """Load `state_dict` (all tensors, or only those that changed since `previous`) into the
        running engine. With `previous`, check that the engine really took it: a silent failure to
        update is a known bug of other trainers (TRL #5312). The parameters' float64 sums must move
        by exactly what the new tensors' sums say (in the engine's dtype; garbage in vocabulary
        padding cancels out, and vLLM zero-fills it anyway)."""
        if self.adapter is not None:
            self._load_adapter(state_dict)
            return
        before = self._parameter_sums() if previous is not None else None
        if self.route == ROUTE_WEIGHT_TRANSFER:
            self._send_by_ipc(complete_modules(state_dict, previous) if previous is not None else state_dict)
        else:
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

    def _send_by_ipc(self, state_dict: Mapping[str, "object"]) -> None:
        """One weight update through vLLM's weight-transfer API, "ipc" backend: each chunk is
        copied onto every worker's GPU (tensor-parallel ranks are this process's first
        `tensor_parallel_size` devices, vLLM's own placement on one node), exported as CUDA IPC
        handles keyed by the GPU's UUID (what ipc_engine.py `receive_weights` looks up), and
        sent. The copies stay alive until `finish_weight_update`: the layer-by-layer reload keeps
        views of them until a layer is complete (vllm/distributed/weight_transfer/ipc_engine.py,
        the trainer side, does the same), so an update needs that much free GPU memory beyond
        the engine's share."""
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        devices = [torch.device("cuda", i) for i in range(self.tensor_parallel_size)]
        uuids = [str(torch.cuda.get_device_properties(d).uuid) for d in devices]
        staged = []
        self.llm.start_weight_update()
        try:
            for part in weight_chunks(state_dict, tied=self.tied):
                names, dtype_names, shapes, handles = [], [], [], []
                for name, tensor in part.items():
                    handle = {}
                    for device, uuid in zip(devices, uuids):
                        copy = tensor.to(device).contiguous()
                        staged.append(copy)
                        handle[uuid] = reduce_tensor(copy)[1]  # rebuild_cuda_tensor's arguments
                    names.append(name)
                    dtype_names.append(str(tensor.dtype).removeprefix("torch."))
                    shapes.append(list(tensor.shape))
                    handles.append(handle)
                torch.cuda.synchronize()
                self.llm.update_weights({"update_info": {"names": names, "dtype_names": dtype_names,
                                                         "shapes": shapes, "ipc_handles": handles}})
        except BaseException:
            try:  # close the session (a worker whose update failed has closed its own and refuses)
                self.llm.finish_weight_update()
            except Exception as exc:  # the first error is the one to report
                logger.debug("finish_weight_update after a failed update: %s", exc)
            raise
        else:
            self.llm.finish_weight_update()
        finally:
            staged.clear()
            torch.cuda.ipc_collect()

    def _parameter_sums(self) -> dict[str, float]:
        # every tensor-parallel rank answers for the parameters (or shards) it holds
        if self.route == ROUTE_WEIGHT_TRANSFER:
            return combine_rank_sums(self.llm.collective_rpc(worker_parameter_sums))
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
        adapter = {"lora_request": self.lora_request} if self.lora_request is not None else {}
        outputs = self.llm.generate(list(prompts), sp, use_tqdm=False, **adapter)  # in prompt order
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
