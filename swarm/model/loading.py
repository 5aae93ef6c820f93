"""Load a policy and its tokenizer: the embedded default, a local directory, or a hub id."""

from __future__ import annotations

from pathlib import Path

EMBEDDED = "embedded"


def resolve_model_dir(model: str | None, *, progress: bool = True) -> str:
    """None or "embedded" -> the embedded policy's directory (built on first use); a local
    directory -> itself; anything else is a hub id (`hub_model`)."""
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
    return hub_model(model)


# How long the check that the hub answers may take (seconds): ample for a slow link, and short
# enough that a machine without network says so at once rather than after ~50 s of retries.
HUB_CHECK_S = 3.0


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set: the hub libraries read only their cache."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_unreachable(timeout_s: float = HUB_CHECK_S) -> str | None:
    """None when the Hugging Face hub (HF_ENDPOINT) answers within `timeout_s`, else why not. The
    request runs in a daemon thread, since a host name lookup takes no timeout of its own."""
    import threading

    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    outcome: list[str | None] = []

    def probe() -> None:
        try:
            get_session().head(constants.ENDPOINT, timeout=timeout_s)  # any HTTP answer means reachable
            outcome.append(None)
        except Exception as exc:  # noqa: BLE001  every transport error means the same here
            outcome.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=probe, name="hub-check", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return outcome[0] if outcome else f"{constants.ENDPOINT} did not answer within {timeout_s:g} s"


def cached_snapshot(model: str) -> str | None:
    """The directory of `model`'s snapshot in the Hugging Face cache, when one is there."""
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(model, local_files_only=True)
    except Exception:  # noqa: BLE001  not cached, or not a valid hub id: either way, no copy
        return None
    return path if (Path(path) / "config.json").exists() else None


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

    from swarm.model.device import resolve_device, resolve_dtype

    device = resolve_device(device)  # "auto" is resolved here for every caller
    dtype = resolve_dtype(dtype, device)
    source = resolve_model_dir(model)
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
