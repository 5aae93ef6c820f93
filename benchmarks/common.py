"""Where benchmark figures go, and how they are written."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    import os

    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


# the markdown files write_result wrote, in order: the runner shows the ones a benchmark wrote
# (a benchmark's variants write under other names, e.g. fanout_wan_grpc)
WRITTEN: list[Path] = []


def write_result(name: str, figures: dict, markdown: str, out: Path = RESULTS) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), **figures}, indent=2))
    (out / f"{name}.md").write_text(markdown)
    WRITTEN.append(out / f"{name}.md")
    return path


def markdown_table(header: list[str], rows: list[list]) -> str:
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
