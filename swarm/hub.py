"""The Hugging Face hub as the project meets it: is it offline (HF_HUB_OFFLINE), does it answer,
is a snapshot in its cache. Used by the model loader (swarm.model.loading) and the dataset task
(swarm.tasks.dataset) alike; on the ground floor: it imports nothing of the project.
"""

from __future__ import annotations

import threading
from pathlib import Path

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
