"""What a model name says about where the model is, checked without torch (a typo in `--model`
fails at once, not after seconds of imports)."""

from __future__ import annotations

from pathlib import Path

LOCAL_PREFIXES = (".", "/", "~")  # a name that starts so is a local directory, never a hub id


def check_local_model(model: str | None) -> None:
    """FileNotFoundError when `model` names a local directory that does not exist."""
    if not model or not model.startswith(LOCAL_PREFIXES):
        return
    try:
        path = Path(model).expanduser()
    except RuntimeError:  # ~name of no user here
        raise FileNotFoundError(f"model directory {model} does not exist: {model.split('/')[0]} names no user here") from None
    if not path.exists():
        raise FileNotFoundError(f"model directory {model} does not exist")
