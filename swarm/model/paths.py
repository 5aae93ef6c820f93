"""What a model name says about where the model is, checked without torch (a typo in `--model`
fails at once, not after seconds of imports)."""

from __future__ import annotations

from pathlib import Path

LOCAL_PREFIXES = (".", "/", "~")  # a name that starts so is a local directory, never a hub id


def check_local_model(model: str | None) -> None:
    """FileNotFoundError when `model` names a local directory that does not exist."""
    if model and model.startswith(LOCAL_PREFIXES) and not Path(model).expanduser().exists():
        raise FileNotFoundError(f"model directory {model} does not exist")
