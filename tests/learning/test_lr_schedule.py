"""--lr-scheduler-type: transformers' schedules after the warm-up, as a function of the version (so
a resumed learner continues the schedule), and what the learner core steps with."""

import math

import pytest
import torch

from swarm.config import LearnerConfig
from swarm.training import LearnerCore, lr_schedule, warmup_factor

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmPeer"


def test_schedules_by_hand():
    warmup, total = 4, 24
    for kind in ("constant", "linear", "cosine"):
        factor = lr_schedule(kind, warmup, total)
        assert [factor(v) for v in range(warmup)] == [warmup_factor(v, warmup) for v in range(warmup)]  # our warm-up
        assert factor(warmup) == pytest.approx(1.0)
    constant, linear, cosine = (lr_schedule(k, warmup, total) for k in ("constant", "linear", "cosine"))
    assert constant(total) == constant(14) == 1.0
    assert linear(14) == pytest.approx((total - 14) / (total - warmup)) and linear(total) == 0.0
    assert cosine(14) == pytest.approx(0.5 * (1 + math.cos(math.pi * (14 - warmup) / (total - warmup))))
    assert cosine(total) == pytest.approx(0.0, abs=1e-12) and linear(total + 5) == 0.0  # past the end: nothing left


def test_the_core_steps_with_the_scheduled_rate_and_a_resumed_core_continues_it():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    def core(version):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, pad_token_id=0))
        config = LearnerConfig(peers=[PEER], lr_scheduler_type="linear", steps=12, lr_warmup_steps=2, learning_rate=1e-3)
        return LearnerCore.from_settings(model, 0, config, version=version)

    fresh = core(0)
    assert [round(fresh.lr_factor(v), 6) for v in (0, 1, 2, 7, 12)] == [0.5, 1.0, 1.0, 0.5, 0.0]
    resumed = core(7)  # built as a resumed learner is: only its version says where the schedule is
    for c in (fresh, resumed):
        c.version = 7
        c.gradient_averager = lambda grads, rows, version: type("Outcome", (), {
            "resync": False, "reason": "", "metrics": {}, "grads": [torch.ones_like(p) for p in c.model.parameters()]})()
    assert fresh.step_with_group()["learning_rate"] == resumed.step_with_group()["learning_rate"] == pytest.approx(5e-4)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        LearnerConfig(peers=[PEER], lr_scheduler_type="exponential")
