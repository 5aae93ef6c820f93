"""Load a policy and its tokenizer: the embedded default, a local directory, or a hub id."""

from __future__ import annotations

from pathlib import Path

from swarm.hub import cached_snapshot, hub_offline, hub_unreachable
from swarm.lora import is_adapter_dir, peft_quietly
from swarm.model.device import resolve_device, resolve_dtype
from swarm.model.embedded import embedded_model_dir
from swarm.model.paths import check_local_model

EMBEDDED = "embedded"


def resolve_model_dir(model: str | None, *, progress: bool = True) -> str:
    """None or "embedded" -> the embedded policy's directory (built on first use); a local
    directory -> itself; anything else is a hub id (`hub_model`)."""
    if model in (None, "", EMBEDDED):
        return str(embedded_model_dir(progress=progress))
    check_local_model(model)  # a local name that does not exist (or names no user) is said at once
    path = Path(model).expanduser()
    if path.exists():
        if is_adapter_dir(path):  # a LoRA run's checkpoint: its adapter, over the base it names
            return str(path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"model directory {path} has no config.json; pass a Hugging Face model directory "
                f"(saved with save_pretrained) or '{EMBEDDED}' for the embedded default"
            )
        return str(path)
    return hub_model(model)


def hub_model(model: str) -> str:
    """A hub id as transformers should load it: the id itself when the hub answers, the cached
    copy when it cannot be reached (or HF_HUB_OFFLINE is set); without either, a clear error at
    once instead of transformers' retries."""
    if hub_offline():
        reason = "HF_HUB_OFFLINE is set"
    else:
        reason = hub_unreachable()
        if reason is None:
            return model
    cached = cached_snapshot(model)
    if cached is not None:
        return cached
    raise ConnectionError(
        f"model {model!r} is not a local directory and the Hugging Face hub cannot be reached: {reason}; nor is it in "
        f"the Hugging Face cache. Pass a local model directory (saved with save_pretrained) or '{EMBEDDED}', or run "
        "where the hub can be reached once to download it"
    )


def load_policy(model: str | None, *, device: str = "cpu", dtype: str = "float32"):
    """(model, tokenizer) ready for generation or training."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a per-tensor "Loading weights" bar is noise in peer logs
    device = resolve_device(device)  # "auto" is resolved here for every caller
    dtype = resolve_dtype(dtype, device)
    source = resolve_model_dir(model)
    if is_adapter_dir(source):
        return _load_adapted(source, device=device, dtype=dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        policy = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype))
    except OSError as exc:
        raise FileNotFoundError(
            f"could not load model {model!r}: {exc}. Pass a local model directory, or '{EMBEDDED}'"
        ) from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return policy.to(device), tokenizer


def _load_adapted(adapter_dir: str, *, device: str, dtype: str):
    """A LoRA checkpoint as a policy to generate with: the base model its adapter_config.json names,
    with the adapter merged into it (no adapter matmuls per token)."""
    import json

    from peft import PeftModel

    base_name = json.loads((Path(adapter_dir) / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base_name:
        raise FileNotFoundError(f"LoRA adapter {adapter_dir} names no base model (base_model_name_or_path in its "
                                "adapter_config.json); load its base with --model and the adapter on it")
    base, tokenizer = load_policy(base_name, device=device, dtype=dtype)
    with peft_quietly():
        return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload(), tokenizer
