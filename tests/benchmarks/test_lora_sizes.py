"""benchmarks/lora.py's version-size arithmetic: r x (in + out) per targeted layer is what PEFT
builds, and the largest rank within a share is the largest whose adapter fits."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from benchmarks.gpu_setup import QWEN3_0_6B, TINY
from benchmarks.lora import TARGET_SETS, arithmetic_adapter_elements, largest_rank_within
from swarm.lora import wrap_lora


@pytest.mark.parametrize("shape", [TINY, QWEN3_0_6B])
def test_the_arithmetic_counts_the_adapter_peft_builds(shape):
    config = Qwen3Config(**shape)
    for targets in TARGET_SETS.values():
        with torch.device("meta"):  # shapes only
            wrapped = wrap_lora(AutoModelForCausalLM.from_config(config), r=16, alpha=32, target_modules=targets)
        built = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
        assert arithmetic_adapter_elements(config, targets, 16) == built


def test_the_largest_rank_within_a_share_is_the_largest_that_fits():
    config = Qwen3Config(**TINY)
    targets, parameters = TARGET_SETS["every projection"], 1_000_000
    r = largest_rank_within(config, targets, 0.02, parameters)
    assert arithmetic_adapter_elements(config, targets, r) <= 0.02 * parameters < arithmetic_adapter_elements(config, targets, r + 1)
