"""Generation backends behind one interface (`GenerationBackend`).

- base.py                  - SamplingParams, Generation (one prompt's G completions), the protocol,
                             and `make_backend(name, ...)`.
- transformers_backend.py  - batched sampling with `model.generate`, CPU or GPU.
- vllm_backend.py          - vLLM engine with in-place weight updates (GPU; optional extra).
"""

from peers.generation.base import Generation, GenerationBackend, SamplingParams, make_backend

__all__ = ["Generation", "GenerationBackend", "SamplingParams", "make_backend"]
