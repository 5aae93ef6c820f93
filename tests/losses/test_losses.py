"""The policy-loss registry: hand-computed values, gradients, masking and numerical range."""

import math

import pytest
import torch

from swarm.losses import LOSSES, LossConfig, LossInputs, clip_range, compute_loss

ALL = sorted(LOSSES)


def two_completion_batch(requires_grad=True):
    """One prompt, two one-token completions: p = (0.4, 0.3), q = (0.5, 0.25), A = (+1, -1)."""
    learner = torch.tensor([[math.log(0.4)], [math.log(0.3)]], requires_grad=requires_grad)
    sampler = torch.tensor([[math.log(0.5)], [math.log(0.25)]])
    return LossInputs(learner, sampler, torch.ones(2, 1), torch.tensor([1.0, -1.0]), torch.tensor([7, 7]))


# Worked by hand from the formulas in DESIGN.md, with kl_coef = 0:
#  token / sequence ratios p/q = 0.8 and 1.2.
#  GEPO: E_q[q] = (0.5^2 + 0.25^2) / (0.5 + 0.25) = 0.41667, weights 0.96 and 0.72;
#        min(0.96 * 1, clip(0.96) * 1) = 0.96; min(-0.72, -clip(0.72) = -0.8) = -0.8 -> loss -(0.96-0.8)/2
#  GRPO-family / GSPO / GMPO (no clip active in the pessimistic direction): -(0.8 - 1.2)/2 = 0.2
#  TOPR: weights 1 (A > 0) and min(1, 1.2) = 1: -(log 0.4 - log 0.3)/2
#  CISPO: sg weights 0.8, 1.2: -(0.8 log 0.4 - 1.2 log 0.3)/2
#  M2PO: neither token is in the trust region (A > 0 with r < 1, A < 0 with r > 1): no mask, -(0.8 - 1.2)/2
#  decoupled PPO, token-TIS + seq-MIS: behaviour weights 0.8, 1.2 (under both caps, sequence ratios in
#        [0.5, 2]) times a proximal ratio of 1: -(0.8 - 1.2)/2
#  OPSM: the A < 0 completion has mean log(q/p) = log(0.25/0.3) < 0, not masked: GRPO's 0.2
#  (tests/losses/test_losses_off_policy.py works each of the new four by hand where their masks act.)
HAND = {
    "gepo": (-(0.96 - 0.8) / 2, 0.5),
    "grpo": (0.2, 0.0),
    "dr_grpo": (0.2, 0.0),
    "bnpo": (0.2, 0.0),
    "gspo": (0.2, 0.0),
    "gmpo": (0.2, 0.0),
    "topr": (-(math.log(0.4) - math.log(0.3)) / 2, 0.5),
    "cispo": (-(0.8 * math.log(0.4) - 1.2 * math.log(0.3)) / 2, 0.0),
    "m2po": (0.2, 0.0),
    "decoupled_ppo": (0.2, 0.0),
    "tis_mis": (0.2, 0.0),
    "opsm": (0.2, 0.0),
}


@pytest.mark.parametrize("name", ALL)
def test_hand_computed_values(name):
    out = compute_loss(two_completion_batch(), LossConfig(name=name, kl_coef=0))
    expected_loss, expected_clip = HAND[name]
    assert out.loss.item() == pytest.approx(expected_loss, abs=1e-6)
    assert out.metrics["clip_frac"].item() == pytest.approx(expected_clip, abs=1e-6)


def test_every_registered_loss_has_a_hand_value():
    assert set(HAND) == set(LOSSES) == {"gepo", "grpo", "dr_grpo", "bnpo", "gspo", "gmpo", "topr", "cispo", "m2po",
                                         "decoupled_ppo", "tis_mis", "opsm"}


def test_gepo_weight_metrics_hand_computed():
    out = compute_loss(two_completion_batch(), LossConfig(name="gepo", kl_coef=0))
    # weights 0.96 and 0.72: mean 0.84, population variance 0.0144
    assert out.metrics["is_weight_mean"].item() == pytest.approx(0.84, abs=1e-6)
    assert out.metrics["is_weight_var"].item() == pytest.approx(0.0144, abs=1e-6)


def test_k3_penalty_and_kl_metric_hand_computed():
    inputs = two_completion_batch()
    out = compute_loss(inputs, LossConfig(name="grpo", kl_coef=0.5))
    k3 = [math.exp(d) - d - 1 for d in (math.log(0.5 / 0.4), math.log(0.25 / 0.3))]
    assert out.metrics["kl_penalty"].item() == pytest.approx(sum(k3) / 2, abs=1e-6)
    assert out.loss.item() == pytest.approx(0.2 + 0.5 * sum(k3) / 2, abs=1e-6)
    kl = [r - 1 - math.log(r) for r in (0.8, 1.2)]  # KL(q||p) estimated on q's samples
    assert out.metrics["kl_sampler_learner"].item() == pytest.approx(sum(kl) / 2, abs=1e-6)
    kl_pq = [r * math.log(r) for r in (0.8, 1.2)]  # KL(p||q) = E_q[r log r]
    assert out.metrics["kl_learner_sampler"].item() == pytest.approx(sum(kl_pq) / 2, abs=1e-6)


def test_gspo_defaults_are_the_gspo_papers_not_grpos():
    assert clip_range(LossConfig(name="gspo")) == (3e-4, 4e-4)
    assert clip_range(LossConfig(name="grpo")) == (0.2, 0.2)
    assert clip_range(LossConfig(name="gspo", eps_high=0.01)) == (3e-4, 0.01)


def test_dr_grpo_normalises_by_fixed_length_and_bnpo_by_token_count():
    # Two sequences of lengths 1 and 3 in a width-4 batch, token ratio 1, A = (1, 1): per-token
    # objective 1 on 4 tokens. Dr.GRPO: 4 / (2 * 4) = 0.5; with max_len 10: 4 / 20; BNPO: 4/4 = 1;
    # GRPO: mean(1, 1) = 1.
    mask = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 0]])
    lp = torch.full((2, 4), -1.0, requires_grad=True)
    inputs = LossInputs(lp, lp.detach().clone(), mask, torch.tensor([1.0, 1.0]), torch.tensor([0, 0]))
    assert compute_loss(inputs, LossConfig(name="dr_grpo", kl_coef=0)).loss.item() == pytest.approx(-0.5)
    cfg = LossConfig(name="dr_grpo", kl_coef=0, max_completion_length=10)
    assert compute_loss(inputs, cfg).loss.item() == pytest.approx(-0.2)
    assert compute_loss(inputs, LossConfig(name="bnpo", kl_coef=0)).loss.item() == pytest.approx(-1.0)
    assert compute_loss(inputs, LossConfig(name="grpo", kl_coef=0)).loss.item() == pytest.approx(-1.0)


def test_gmpo_clips_log_ratio_in_log_space_pessimistically():
    # A > 0, token log-ratios (+1.0, -1.0): upper clip applies to +1.0 -> 0.4, the low side is kept
    # (pessimistic min) -> geometric weight exp((0.4 - 1.0) / 2).
    lp = torch.tensor([[1.0, -1.0]], requires_grad=True)
    inputs = LossInputs(lp, torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([2.0]), torch.tensor([0]))
    out = compute_loss(inputs, LossConfig(name="gmpo", kl_coef=0))
    assert out.loss.item() == pytest.approx(-2.0 * math.exp((0.4 - 1.0) / 2), abs=1e-6)
    assert out.metrics["clip_frac"].item() == pytest.approx(0.5)
    # A < 0: now the low side is clipped at -0.4 and +1.0 is kept.
    inputs = LossInputs(lp, torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([-2.0]), torch.tensor([0]))
    out = compute_loss(inputs, LossConfig(name="gmpo", kl_coef=0))
    assert out.loss.item() == pytest.approx(2.0 * math.exp((1.0 - 0.4) / 2), abs=1e-6)


@pytest.mark.parametrize("adv, log_ratio, kept, clipped", [
    # The GMPO paper's rule: log r is bounded to [-eps_low, eps_high] = [-0.2, 0.5] whatever the sign
    # of A; the pessimistic side is min for A > 0, max for A < 0.
    (-1.0, -0.3, -0.2, True),   # A < 0, ratio below the range: raised to e^-0.2 (eps_low, not eps_high)
    (-1.0, 0.6, 0.6, False),    # A < 0, ratio above: the larger (worse) ratio is kept
    (1.0, 0.6, 0.5, True),      # A > 0, ratio above: cut to e^0.5 (eps_high)
    (1.0, -0.3, -0.3, False),   # A > 0, ratio below: kept
])
def test_gmpo_asymmetric_clip_range_applies_to_the_log_ratio_for_either_sign(adv, log_ratio, kept, clipped):
    lp = torch.tensor([[log_ratio]], requires_grad=True)
    inputs = LossInputs(lp, torch.zeros(1, 1), torch.ones(1, 1), torch.tensor([adv]), torch.tensor([0]))
    out = compute_loss(inputs, LossConfig(name="gmpo", kl_coef=0, eps_low=0.2, eps_high=0.5))
    assert out.loss.item() == pytest.approx(-adv * math.exp(kept), abs=1e-6)
    (grad,) = torch.autograd.grad(out.loss, lp)
    # a clipped token carries no gradient; a kept one the gradient of -A * e^(log r)
    assert grad.item() == pytest.approx(0.0 if clipped else -adv * math.exp(log_ratio), abs=1e-6)
    assert out.metrics["clip_frac"].item() == (1.0 if clipped else 0.0)


def topr_batch():
    """A > 0: two tokens, p = (0.5, 0.25), q = 0.5 each. A < 0: p = (0.2, 0.3), q = (0.4, 0.6): token
    ratios 0.5 and 0.5, so the whole sequence's ratio is 0.25 and its per-token geometric mean 0.5."""
    learner = torch.log(torch.tensor([[0.5, 0.25], [0.2, 0.3]])).requires_grad_(True)
    sampler = torch.log(torch.tensor([[0.5, 0.5], [0.4, 0.6]]))
    return learner, LossInputs(learner, sampler, torch.ones(2, 2), torch.tensor([1.0, -1.0]), torch.tensor([0, 0]))


def test_topr_paper_form_weights_by_the_whole_sequence_ratio_and_sums_token_logprobs():
    learner, inputs = topr_batch()
    pos, neg = math.log(0.5) + math.log(0.25), math.log(0.2) + math.log(0.3)  # log pi(y), summed
    for mode in ("mean", "sum"):  # the paper's form does not depend on seq_logprob_mode
        out = compute_loss(inputs, LossConfig(name="topr", kl_coef=0, seq_logprob_mode=mode))
        # -(1/2) * (1 * (+1) * log pi(y1) + min(1, 0.25) * (-1) * log pi(y2))
        assert out.loss.item() == pytest.approx(-(pos - 0.25 * neg) / 2, abs=1e-6)
        (grad,) = torch.autograd.grad(out.loss, learner)
        assert torch.allclose(grad, torch.tensor([[-0.5, -0.5], [0.125, 0.125]]), atol=1e-6)
    assert LossConfig().topr_form == "paper"


def test_topr_normalised_form_is_the_earlier_one():
    learner, inputs = topr_batch()
    pos, neg = (math.log(0.5) + math.log(0.25)) / 2, (math.log(0.2) + math.log(0.3)) / 2  # per-token means
    out = compute_loss(inputs, LossConfig(name="topr", kl_coef=0, topr_form="normalised"))
    # seq_logprob_mode "mean": the weight is the geometric mean 0.5, four times the paper's 0.25
    assert out.loss.item() == pytest.approx(-(pos - 0.5 * neg) / 2, abs=1e-6)
    out = compute_loss(inputs, LossConfig(name="topr", kl_coef=0, topr_form="normalised", seq_logprob_mode="sum"))
    assert out.loss.item() == pytest.approx(-(pos - 0.25 * neg) / 2, abs=1e-6)


def test_k3_penalty_keeps_float32_precision_near_on_policy():
    from swarm.losses.kl import k3_penalty, kl_sampler_learner

    def exact(d):  # exp(d) - d - 1 in float64
        return float((torch.expm1(d.double()) - d.double()).mean())

    # One token at log-ratio 1e-3: exp(x) - x - 1 in float32 is off by about 5%; expm1(x) - x by 1e-4.
    x = torch.tensor([[1e-3]])
    assert abs(k3_penalty(torch.zeros(1, 1), x, torch.ones(1, 1)).item() - exact(x)) / exact(x) < 1e-3
    assert abs(kl_sampler_learner(x, torch.zeros(1, 1), torch.ones(1, 1)).item() - exact(x)) / exact(x) < 1e-3
    assert abs(float(torch.exp(x) - x - 1) - exact(x)) / exact(x) > 1e-2  # the old form, for contrast
    # Token log-ratio sd 0.02 over 4096 tokens at realistic log-probs (s - l is exact in float32 here).
    gen = torch.Generator().manual_seed(0)
    learner = -1 - torch.rand(1, 4096, generator=gen)
    sampler = learner + 0.02 * torch.randn(1, 4096, generator=gen)
    d = sampler - learner
    assert torch.equal(d.double(), sampler.double() - learner.double())
    value = k3_penalty(learner, sampler, torch.ones(1, 4096)).item()
    assert abs(value - exact(d)) / exact(d) < 1e-7
    assert abs(float((torch.exp(d) - d - 1).mean()) - exact(d)) / exact(d) > 3e-7  # the old form


def test_cispo_caps_the_weight_at_scalerls_4_and_keeps_dapos_cap_as_an_option():
    # One token with ratio 5 and A = 1: the stop-gradient weight is min(5, 4) = 4; with --eps-high 0.28,
    # the registry's earlier cap, it is 1.28.
    lp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    inputs = LossInputs(lp, torch.tensor([[math.log(0.1)]]), torch.ones(1, 1), torch.tensor([1.0]), torch.tensor([0]))
    assert clip_range(LossConfig(name="cispo")) == (1.0, 3.0)
    out = compute_loss(inputs, LossConfig(name="cispo", kl_coef=0))
    assert out.loss.item() == pytest.approx(-4.0 * math.log(0.5), abs=1e-6)
    assert torch.autograd.grad(out.loss, lp)[0].item() == pytest.approx(-4.0, abs=1e-6)
    out = compute_loss(inputs, LossConfig(name="cispo", kl_coef=0, eps_high=0.28))
    assert out.loss.item() == pytest.approx(-1.28 * math.log(0.5), abs=1e-6)
    assert out.metrics["clip_frac"].item() == 1.0


def test_gepo_expectation_is_per_prompt_group_not_per_batch():
    # Two prompts whose sampler probabilities differ a lot: per-group expectations differ, the
    # "batch" mode (the reference implementation's behaviour) mixes them.
    s = torch.tensor([[-0.1], [-0.2], [-5.0], [-5.5]])
    lp = s.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    inputs = LossInputs(lp, s, torch.ones(4, 1), adv, torch.tensor([0, 0, 1, 1]))
    per_group = compute_loss(inputs, LossConfig(name="gepo", kl_coef=0))
    batch = compute_loss(inputs, LossConfig(name="gepo", kl_coef=0, gepo_expectation="batch"))

    def log_e(vals):
        return math.log(sum(math.exp(2 * v) for v in vals)) - math.log(sum(math.exp(v) for v in vals))

    w_group = [math.exp(-0.1 - log_e([-0.1, -0.2])), math.exp(-5.0 - log_e([-5.0, -5.5]))]
    w_batch2 = math.exp(-5.0 - log_e([-0.1, -0.2, -5.0, -5.5]))
    assert per_group.metrics["is_weight_mean"].item() == pytest.approx(
        (w_group[0] + math.exp(-0.2 - log_e([-0.1, -0.2])) + w_group[1] + math.exp(-5.5 - log_e([-5.0, -5.5]))) / 4,
        rel=1e-5,
    )
    # mixing prompts, the unlikely prompt's completions get a weight far below their group's
    assert w_batch2 < 0.05 * w_group[1]
    assert abs(per_group.loss.item() - batch.loss.item()) > 1e-3


@pytest.mark.parametrize("mode", ["mean", "sum"])
def test_gepo_equals_gspo_ratio_when_sampler_probs_equal_in_group(mode):
    torch.manual_seed(1)
    b, t = 6, 5
    # Each group's completions share the same sampler sequence log-prob.
    base = torch.randn(b, t) - 2
    sampler = base.clone()
    sampler[1] = sampler[0]
    sampler[2] = sampler[0]
    sampler[4] = sampler[3]
    sampler[5] = sampler[3]
    learner = (sampler + 0.05 * torch.randn(b, t)).requires_grad_(True)
    adv = torch.randn(b)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    inputs = LossInputs(learner, sampler, torch.ones(b, t), adv, groups)
    cfg = dict(kl_coef=0, eps_low=0.2, eps_high=0.2, seq_logprob_mode=mode)
    gepo = compute_loss(inputs, LossConfig(name="gepo", **cfg))
    gspo = compute_loss(inputs, LossConfig(name="gspo", **cfg))
    assert gepo.loss.item() == pytest.approx(gspo.loss.item(), abs=1e-6)
    assert gepo.metrics["is_weight_mean"].item() == pytest.approx(gspo.metrics["is_weight_mean"].item(), abs=1e-6)
    g1 = torch.autograd.grad(gepo.loss, learner, retain_graph=True)[0]
    g2 = torch.autograd.grad(gspo.loss, learner)[0]
    assert torch.allclose(g1, g2, atol=1e-6)


@pytest.mark.parametrize("name", ALL)
def test_gradients_flow_to_learner_logprobs_only(name):
    b, t = 4, 6
    learner = (torch.randn(b, t) - 1).requires_grad_(True)
    sampler = (learner.detach() + 0.1 * torch.randn(b, t)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], requires_grad=True)
    inputs = LossInputs(learner, sampler, torch.ones(b, t), adv, torch.tensor([0, 0, 1, 1]))
    compute_loss(inputs, LossConfig(name=name)).loss.backward()
    assert learner.grad is not None and learner.grad.abs().sum() > 0
    assert sampler.grad is None
    assert adv.grad is None


@pytest.mark.parametrize("name", ALL)
def test_padding_never_changes_the_loss(name):
    b, t = 4, 5
    learner = torch.randn(b, t) - 1
    sampler = learner + 0.2 * torch.randn(b, t)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.float32)
    adv = torch.tensor([1.0, -1.0, 0.7, -0.3])
    groups = torch.tensor([3, 3, 9, 9])
    # max_completion_length pinned so Dr.GRPO's normaliser does not depend on the padded width
    cfg = LossConfig(name=name, max_completion_length=8)

    lp1 = learner.clone().requires_grad_(True)
    out1 = compute_loss(LossInputs(lp1, sampler, mask, adv, groups), cfg)
    out1.loss.backward()

    # Same data with garbage in padded positions and three extra padding columns.
    garbage = torch.full((b, 3), -37.0)
    lp2_data = torch.cat([torch.where(mask > 0, learner, torch.full_like(learner, 5.0)), garbage], 1)
    s2 = torch.cat([torch.where(mask > 0, sampler, torch.full_like(sampler, -80.0)), garbage - 3], 1)
    mask2 = torch.cat([mask, torch.zeros(b, 3)], 1)
    lp2 = lp2_data.clone().requires_grad_(True)
    out2 = compute_loss(LossInputs(lp2, s2, mask2, adv, groups), cfg)
    out2.loss.backward()

    assert out2.loss.item() == pytest.approx(out1.loss.item(), abs=1e-6)
    for key in out1.metrics:
        assert out2.metrics[key].item() == pytest.approx(out1.metrics[key].item(), abs=1e-5), key
    assert torch.allclose(lp2.grad[:, :t] * mask, lp1.grad, atol=1e-7)
    assert torch.all(lp2.grad[:, :t][mask == 0] == 0) and torch.all(lp2.grad[:, t:] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["mean", "sum"])
@pytest.mark.parametrize("name", ALL)
def test_long_sequences_and_tiny_logprobs_stay_finite(name, mode, dtype):
    b, t = 4, 4096
    gen = torch.Generator().manual_seed(3)
    learner = (-60 * torch.rand(b, t, generator=gen)).to(dtype).requires_grad_(True)
    sampler = (-60 * torch.rand(b, t, generator=gen)).to(dtype)
    mask = torch.ones(b, t)
    mask[1, 3000:] = 0
    inputs = LossInputs(learner, sampler, mask, torch.tensor([2.0, -2.0, 1.0, -1.0]), torch.tensor([0, 0, 1, 1]))
    out = compute_loss(inputs, LossConfig(name=name, seq_logprob_mode=mode))
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(v) for v in out.metrics.values())
    assert learner.grad.dtype == dtype
    assert torch.isfinite(learner.grad.float()).all()


def test_bad_inputs_and_unknown_loss_are_named():
    with pytest.raises(ValueError, match="Input should be 'gepo', 'grpo'"):
        LossConfig(name="ppo")
    with pytest.raises(ValueError, match="extra"):
        LossConfig(name="gepo", eps=0.1)
    lp = torch.zeros(2, 3)
    bad = LossInputs(lp, torch.zeros(2, 4), torch.ones(2, 3), torch.zeros(2), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="sampler_logprobs has shape"):
        compute_loss(bad)


def test_the_configs_loss_choices_are_exactly_the_registered_losses():
    """swarm.config lists the loss names (so option choices need no torch); the registry is the truth."""
    from swarm.config import LOSS_NAMES

    assert sorted(LOSS_NAMES) == sorted(LOSSES)
