"""Load a policy and its tokenizer: the embedded default, a local directory, or a hub id."""

from __future__ import annotations

from pathlib import Path

EMBEDDED = "embedded"
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}


def resolve_model_dir(model: str | None, *, progress: bool = True) -> str:
    """None or "embedded" -> the embedded policy's directory (built on first use); a local
    directory -> itself; anything else is passed on as a hub id."""
    if model in (None, "", EMBEDDED):
        from swarm.model.embedded import embedded_model_dir

        return str(embedded_model_dir(progress=progress))
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"model directory {path} has no config.json; pass a Hugging Face model directory "
                f"(saved with save_pretrained) or '{EMBEDDED}' for the embedded default"
            )
        return str(path)
    if model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model directory {model} does not exist")
    return model  # a hub id: transformers resolves it (needs network or a populated HF cache)


def load_policy(model: str | None, *, device: str = "cpu", dtype: str = "float32"):
    """(model, tokenizer) ready for generation or training."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a per-tensor "Loading weights" bar is noise in peer logs

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of: {', '.join(sorted(DTYPES))}")
    source = resolve_model_dir(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        policy = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, DTYPES[dtype]))
    except OSError as exc:
        raise FileNotFoundError(
            f"could not load model {model!r}: {exc}. Pass a local model directory, or '{EMBEDDED}'"
        ) from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return policy.to(device), tokenizer
