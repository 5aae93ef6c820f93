"""benchmarks/version_memory.py builds Qwen3-0.6B's shapes and moves the share of elements it says."""

import math

import torch

from benchmarks.version_memory import CHANGED, first_state, next_state, qwen3_06b_shapes


def test_the_shapes_are_qwen3_06b_with_tied_embeddings_once():
    params = sum(math.prod(s) for s in qwen3_06b_shapes().values())
    assert 595_000_000 < params < 597_000_000  # 596 M: Qwen3-0.6B without the tied output layer


def test_a_generated_version_moves_about_the_share_of_elements_by_one_step():
    gen = torch.Generator().manual_seed(0)
    state = first_state(qwen3_06b_shapes(scale=0.01, layers=1), gen)
    after = next_state(state, gen)
    moved = sum(int((a.view(torch.int16) != b.view(torch.int16)).sum()) for a, b in zip(state.values(), after.values()))
    total = sum(t.numel() for t in state.values())
    assert 0.8 * CHANGED < moved / total <= CHANGED
    steps = torch.cat([(b.view(torch.int16).int() - a.view(torch.int16).int()).flatten() for a, b in zip(state.values(), after.values())])
    assert set(steps.unique().tolist()) <= {-2, -1, 0, 1, 2}  # (an element drawn twice may move two steps)
