"""LoRA runs: the policy is a frozen base model plus a low-rank adapter (Hu et al. 2021), trained
and published alone.

- `wrap_lora`        - the base model wrapped by PEFT with a LoRA adapter (B at zero: the wrapped model
                       is the base model until its first step); a target module the model lacks is refused.
- `AdapterSpec`      - what a sampler needs to build the same adapter: r, alpha, target modules, and
                       the base model's hash (announced, signed, with every version).
- `policy_state` / `load_policy_state` - a model's published state: the adapter's tensors in a LoRA
                       run, the whole state (a tied parameter once) otherwise; loaded strictly.
- `base_state`       - the base model's own state under its own names, in bfloat16: what its hash is
                       taken over (float32 and bfloat16 copies of one base hash the same).
- `trainable_parameters` - what the optimizer steps, learners average and checkpoints keep.
- `set_merged`       - merge the adapter into the base weights (no per-token adapter matmuls) or not.
- `adapter_files`    - the adapter in PEFT's on-disk format (adapter_config.json and
                       adapter_model.safetensors), as vLLM's LoRARequest and PeftModel.from_pretrained read it.

Imports of peft happen in the functions: a full fine-tuning run never loads it.
"""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import torch

from swarm.tied_weights import load_unique_state, unique_state

ADAPTER = "default"  # PEFT's adapter name: its tensors are named `...lora_A.default.weight`
BASE_HASH_DTYPE = torch.bfloat16  # the base is hashed in bfloat16: what float32 and bfloat16 samplers agree on


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA run's adapter, as a sampler rebuilds it: rank, alpha, target modules and the hash of
    the frozen base model every peer must hold."""

    r: int
    alpha: float
    target_modules: tuple[str, ...]
    base_hash: str

    def describe(self) -> str:
        return f"LoRA r={self.r}, alpha={self.alpha:g}, on {', '.join(self.target_modules)}"


def describe(spec: AdapterSpec | None) -> str:
    """What a run trains: its adapter over its base, or every weight (None)."""
    return f"{spec.describe()} over base {spec.base_hash[:16]}" if spec is not None else "every weight"


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def _is_adapter_name(name: str) -> bool:
    return ".lora_" in name


def linear_module_names(model) -> set[str]:
    """The last part of the name of every linear layer of `model` (what --lora-target-modules names)."""
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def check_targets(model, target_modules: Sequence[str]) -> None:
    """ValueError naming --lora-target-modules when one of them is no linear layer of `model`."""
    present = linear_module_names(model)
    unknown = [name for name in target_modules if name not in present]
    if unknown:
        raise ValueError(f"--lora-target-modules: {', '.join(unknown)} is no linear layer of this model; its linear "
                         f"layers are {', '.join(sorted(present))}")


def wrap_lora(model, *, r: int, alpha: float, dropout: float = 0.0, target_modules: Sequence[str]):
    """`model` wrapped with a fresh LoRA adapter; only the adapter trains (the base is frozen)."""
    from peft import LoraConfig, get_peft_model

    if r < 1:
        raise ValueError(f"--lora-r {r}: a LoRA adapter needs a rank of 1 or more")
    check_targets(model, target_modules)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules), bias="none",
                        task_type="CAUSAL_LM")
    with peft_quietly():
        return get_peft_model(model, config)


@contextmanager
def peft_quietly():
    """Around a peft call that wraps a model: peft reads the model's old name of its checkpointing
    flag, which transformers 5 warns of (a FutureWarning in every LoRA peer's log, about peft's code)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def wrap_for(model, settings):
    """`model` wrapped as a run's LoRA settings (swarm.config.LoraSettings) say; unchanged when lora_r is 0."""
    if not settings.lora_r:
        return model
    return wrap_lora(model, r=settings.lora_r, alpha=settings.lora_alpha, dropout=settings.lora_dropout,
                     target_modules=settings.lora_target_modules)


def wrap_as(model, spec: AdapterSpec):
    """`model` wrapped with the (zero) adapter `spec` describes, ready for a version's tensors (a sampler)."""
    return wrap_lora(model, r=spec.r, alpha=spec.alpha, target_modules=spec.target_modules).eval()


def adapter_spec(model, base_hash: str) -> AdapterSpec:
    config = model.peft_config[ADAPTER]
    return AdapterSpec(int(config.r), float(config.lora_alpha), tuple(sorted(config.target_modules)), base_hash)


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """The parameters that train: the adapter's in a LoRA run, every one otherwise."""
    return [p for p in model.parameters() if p.requires_grad]


def policy_state(model, dtype: torch.dtype | None = None, *, copy: bool = False,
                 on_host: bool = True) -> dict[str, torch.Tensor]:
    """What a version of `model` is: the adapter's tensors of a LoRA model, else its unique state
    (swarm.tied_weights). `dtype` casts floating tensors; `copy`: copies, never views, on the CPU or,
    with `on_host=False`, where the model is (swarm.tied_weights.unique_state)."""
    if not is_lora(model):
        return unique_state(model, dtype, copy=copy, on_host=on_host)
    out = {}
    for name, tensor in model.state_dict().items():
        if _is_adapter_name(name):
            t = tensor.detach()
            cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
            out[name] = t.to("cpu" if on_host else None, cast, copy=True) if copy else t.to(cast)
    return out


def load_policy_state(model, state: Mapping[str, torch.Tensor]) -> None:
    """Load a version into `model` strictly: exactly the adapter's tensors of a LoRA model (the base
    is untouched), else the whole state (swarm.tied_weights.load_unique_state)."""
    if not is_lora(model):
        if any(_is_adapter_name(name) for name in state):
            raise RuntimeError("this version is a LoRA adapter, but the model holds none (the run is a LoRA run: its "
                               "announcements name the adapter)")
        load_unique_state(model, state)
        return
    own = {name: t for name, t in model.state_dict().items() if _is_adapter_name(name)}
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    wrong = [n for n in own if n in state and tuple(state[n].shape) != tuple(own[n].shape)]
    if missing or unexpected or wrong:
        raise RuntimeError(f"the version does not fit this LoRA adapter: missing {missing[:3]}, unexpected {unexpected[:3]}, "
                           f"other shapes {wrong[:3]} (another rank or other target modules?)")
    merged = is_merged(model)
    if merged:
        model.unmerge_adapter()
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(state[name])
    if merged:
        model.merge_adapter()


def base_name(name: str) -> str:
    """A wrapped model's name of a base tensor, as the unwrapped model names it."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def base_state(model) -> dict[str, torch.Tensor]:
    """The base model's own state (a tied parameter once) under the unwrapped model's names, in
    bfloat16 on the CPU: what its hash is taken over, whether `model` is wrapped or not."""
    state = unique_state(model)
    if is_lora(model):
        state = {base_name(k): v for k, v in state.items() if not _is_adapter_name(k)}
    return {k: v.to("cpu", BASE_HASH_DTYPE if v.is_floating_point() else v.dtype) for k, v in state.items()}


def is_merged(model) -> bool:
    from peft.tuners.lora import LoraLayer

    return any(module.merged for module in model.modules() if isinstance(module, LoraLayer))


def set_merged(model, merged: bool) -> None:
    """Merge the adapter into the base weights (generation runs at the base model's speed; each new
    version is unmerged and merged again, rounding the base weights in their dtype) or keep it apart."""
    if merged and not is_merged(model):
        model.merge_adapter()
    elif not merged and is_merged(model):
        model.unmerge_adapter()


def peft_name(name: str) -> str:
    """A wrapped model's adapter tensor name, as PEFT's files name it (without the adapter name)."""
    return name.replace(f".{ADAPTER}.", ".")


def adapter_files(state: Mapping[str, torch.Tensor], spec: AdapterSpec, out_dir: Path, *, base_model: str = "") -> Path:
    """Write an adapter version in PEFT's format: adapter_config.json and adapter_model.safetensors."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=list(spec.target_modules), bias="none",
                        task_type="CAUSAL_LM", base_model_name_or_path=base_model or None)
    config.save_pretrained(str(out_dir))
    save_file({peft_name(k): v.detach().contiguous().cpu() for k, v in state.items()}, str(out_dir / "adapter_model.safetensors"))
    return out_dir


def is_adapter_dir(path) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


def adapter_rank(path) -> int:
    return int(json.loads((Path(path) / "adapter_config.json").read_text())["r"])
