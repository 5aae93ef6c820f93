"""Group-normalised advantages: std / no-std / Beta, equal-reward groups, missing rewards."""

import math

import pytest
import torch

from swarm.advantages import group_advantages

NAN = float("nan")


def test_std_mode_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = group_advantages(rewards, groups, "std", eps=0.0)
    std = math.sqrt(((0.5**2) * 4) / 3)  # unbiased std of (1, 0, 0, 1)
    assert adv[:4].tolist() == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-6)
    assert adv[4:].tolist() == [0.0, 0.0]  # equal rewards: no signal


def test_no_std_mode_is_centred_rewards():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([5, 5, 5, 5]), "no_std")
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_missing_rewards_are_kept_out_of_the_baseline():
    rewards = torch.tensor([1.0, NAN, 0.0, 0.0])
    adv = group_advantages(rewards, torch.zeros(4, dtype=torch.long), "no_std")
    # baseline over (1, 0, 0) = 1/3, the unscorable completion gets 0
    assert adv.tolist() == pytest.approx([2 / 3, 0.0, -1 / 3, -1 / 3])
    assert torch.isfinite(adv).all()


def test_group_with_single_present_reward_gets_zero():
    adv = group_advantages(torch.tensor([1.0, NAN, NAN]), torch.tensor([0, 0, 0]), "std")
    assert adv.tolist() == [0.0, 0.0, 0.0]


def test_beta_mode_hand_computed():
    # Three prompts of 4 completions with accuracies 0.25, 0.5, 0.75.
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0])
    groups = torch.tensor([0] * 4 + [1] * 4 + [2] * 4)
    adv = group_advantages(rewards, groups, "beta")
    m, v = 0.5, 0.0625  # mean and unbiased variance of (0.25, 0.5, 0.75)
    common = m * (1 - m) / v - 1  # 3
    alpha = beta = 1 + common * 0.5 / 3  # 1.5
    def pdf(p):
        return p ** (alpha - 1) * (1 - p) ** (beta - 1) / (math.gamma(alpha) * math.gamma(beta) / math.gamma(alpha + beta))
    assert adv[0].item() == pytest.approx((1 - 0.25) / pdf(0.25), rel=1e-5)
    assert adv[5].item() == pytest.approx((1 - 0.5) / pdf(0.5), rel=1e-5)
    assert adv[11].item() == pytest.approx((0 - 0.75) / pdf(0.75), rel=1e-5)


def test_beta_mode_degenerate_fit_falls_back_to_centred_rewards():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    adv = group_advantages(rewards, torch.tensor([0, 0, 1, 1]), "beta")
    assert adv.tolist() == pytest.approx([0.5, -0.5, 0.5, -0.5])


def test_bad_shapes_and_modes_are_refused():
    with pytest.raises(ValueError, match="must both be"):
        group_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="unknown advantage mode"):
        group_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), "zscore")
