"""Where a peer runs its policy and in which precision: `--device auto` takes CUDA when present, and
`--dtype auto` takes bfloat16 on a GPU and float32 on a CPU (bfloat16 matmuls on CPUs without
AMX are slower than float32, and CPU peers are for small models anyway)."""

from __future__ import annotations

DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when a CUDA device is present, else "cpu"; anything else is checked and
    returned as given ("cuda:1", "cpu")."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is available here; use --device cpu (or auto)")
    try:
        torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, auto): {exc}") from None
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """"auto" -> bfloat16 on a GPU, float32 elsewhere; a name or alias -> its canonical name."""
    if dtype == "auto":
        return "bfloat16" if resolve_device(device).startswith("cuda") else "float32"
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of: auto, {', '.join(sorted(DTYPE_NAMES))}")
    return DTYPE_NAMES[dtype]


def torch_dtype(name: str):
    import torch

    return getattr(torch, DTYPE_NAMES[name])
