"""Generation backends behind one interface (`GenerationBackend`).

- base.py                  - SamplingParams, Generation (one prompt's G completions) and the protocol.
- transformers_backend.py  - batched sampling with `model.generate`, CPU or GPU.
- vllm_backend.py          - vLLM engine with in-place weight updates (GPU; optional extra: vllm itself
                             is imported only when chosen, and not yet run on a GPU by this project's tests).

`make_backend(name, ...)` is the one place a backend is chosen.
"""

from __future__ import annotations

from swarm.generation.base import Generation, GenerationBackend, SamplingParams
from swarm.generation.transformers_backend import TransformersBackend
from swarm.generation.vllm_backend import VLLMBackend

BACKENDS = ("transformers", "vllm")


def make_backend(name: str, model_dir: str, **kwargs) -> GenerationBackend:
    """Create the named backend for a model directory (vLLM is imported only if chosen)."""
    if name == "transformers":
        return TransformersBackend.from_pretrained(model_dir, **kwargs)
    if name == "vllm":
        return VLLMBackend(model_dir, **kwargs)
    raise ValueError(f"unknown generation backend {name!r}; choose one of: {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Generation", "GenerationBackend", "SamplingParams", "make_backend"]
