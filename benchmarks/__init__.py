"""Benchmarks: figures written to benchmarks/results/, measured as ratios against a baseline run in
the same process. `bash dev.sh bench` (or `python -m benchmarks`) runs them all.

- is_variance.py            - Var(p/q) vs Var(p/E_q[q]) across KL(p||q) (GEPO paper, Theorem 1, Fig. 2).
- learner_overhead.py       - one GEPO optimizer step vs a plain forward/backward/step.
- generation_throughput.py  - the generation backend vs raw `model.generate`; rewards scored per second.
- generation_memory.py      - the sampler's memory at 64 and 256 new tokens with Qwen3's vocabulary, and its
                              tokens/s against plain `model.generate` (the code before, as a baseline).
- learner_step.py           - a learner step against a bare Hugging Face forward and backward with its own loss,
                              with Qwen3's vocabulary, and a profile of both.
- length_buckets.py        - the learner's decoder on length buckets against one run padded to the longest row.
- gpu_check.py              - every GPU claim in one command (sections in gpu_sections.py); `--small` on CPU.
- import_graph.py           - the project's own import graph: levels, edges, upward edges, circles.

The others say what they measure in their own docstrings; `python -m benchmarks --help` lists them.
"""
