"""Where the project keeps its files on the user's machine: the cache directory (built policies,
the peer identity keys). On the ground floor: it imports nothing of the project, so any layer may
use it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$GEPO_SWARM_CACHE, else $XDG_CACHE_HOME/gepo-swarm (~/.cache/gepo-swarm by default)."""
    root = os.environ.get("GEPO_SWARM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "gepo-swarm"
    )
    return Path(root)


def models_cache() -> Path:
    """Where policies built on first use (the embedded one, the midsize ones) are cached."""
    return cache_root() / "models"
