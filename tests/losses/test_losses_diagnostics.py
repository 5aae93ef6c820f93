"""Diagnostics of the clipped objectives (swarm/losses/diagnostics.py, step_diagnostics.py; issue #19,
item 4): clip fractions and gradient coefficients by sign of advantage, GEPO's weight split into its
on-policy factor and the sequence's own ratio, and the per-step gradient and movement measures.
Values worked by hand; the coefficient shares checked against autograd's gradient."""

import copy
import math

import pytest
import torch

from swarm.losses import LossConfig, LossInputs, compute_loss
from swarm.losses.diagnostics import gepo_weight_metrics, sign_split_metrics
from swarm.losses.step_diagnostics import StepDiagnostics


def three_completion_group(requires_grad=True):
    """One prompt, three one-token completions: q = (0.6, 0.3, 0.1), p = (0.6, 0.15, 0.2), A = (1, -2, 1).

    E_q[q] = (0.36 + 0.09 + 0.01) / 1 = 0.46, so w0 = q / E_q[q] = (30, 15, 5) / 23, rho = p / q =
    (1, 0.5, 2) and the GEPO weight w = p / E_q[q] = (30, 7.5, 10) / 23 = (1.304, 0.326, 0.435).
    With the clip range 0.2:
      1: A > 0, w = 1.304 > 1.2: clipped, though its own ratio is 1 (clipped by w0 alone);
      2: A < 0, w = 0.326 < 0.8: clipped (its ratio 0.5 is past the range too);
      3: A > 0, w = 0.435: not clipped, though its ratio 2 is past 1.2: it escapes the trust region.
    """
    learner = torch.tensor([[math.log(0.6)], [math.log(0.15)], [math.log(0.2)]], requires_grad=requires_grad)
    sampler = torch.tensor([[math.log(0.6)], [math.log(0.3)], [math.log(0.1)]])
    return LossInputs(learner, sampler, torch.ones(3, 1), torch.tensor([1.0, -2.0, 1.0]), torch.tensor([4, 4, 4]))


def test_gepo_sign_split_and_weight_factors_hand_computed():
    out = compute_loss(three_completion_group(), LossConfig(name="gepo", beta=0))
    m = out.metrics_as_floats()
    # objectives: min(1.304, 1.2) = 1.2; min(-0.652, -1.6) = -1.6; 10/23
    assert out.loss.item() == pytest.approx(-(1.2 - 1.6 + 10 / 23) / 3, abs=1e-6)
    assert m["adv_pos_frac"] == pytest.approx(2 / 3) and m["adv_neg_frac"] == pytest.approx(1 / 3)
    assert m["clip_frac_pos"] == pytest.approx(1 / 3) and m["clip_frac_neg"] == pytest.approx(1 / 3)
    assert m["clip_frac"] == pytest.approx(m["clip_frac_pos"] + m["clip_frac_neg"])
    assert m["coef_pos_share"] == pytest.approx(1.0) and m["coef_net"] == pytest.approx(1.0)  # only completion 3 pushes
    w0 = [30 / 23, 15 / 23, 5 / 23]
    mean = sum(w0) / 3
    assert m["gepo_w0_mean"] == pytest.approx(mean, rel=1e-6)
    assert m["gepo_w0_sd"] == pytest.approx(math.sqrt(sum((w - mean) ** 2 for w in w0) / 3), rel=1e-5)
    assert m["gepo_w0_adv"] == pytest.approx((30 - 2 * 15 + 5) / 23 / 3, rel=1e-5)  # 5/69
    assert m["gepo_w0_out"] == pytest.approx(1.0)  # 1.304, 0.652, 0.217 are all outside [0.8, 1.2]
    assert m["seq_log_ratio_abs"] == pytest.approx(2 * math.log(2) / 3, rel=1e-6)
    assert m["trust_escape_frac"] == pytest.approx(1 / 3)
    assert m["clip_by_bias_frac"] == pytest.approx(1 / 3)


def test_gepo_ratio_clip_hand_computed():
    """gepo_clip="ratio": w0 * min(rho A, clip(rho) A). rho = (1, 0.5, 2): 1 is inside the range
    (objective w0 * 1 * 1 = 30/23, the gradient GEPO's w A), 2 is clipped at 0.8 (15/23 * 0.8 * -2),
    3 at 1.2 (5/23 * 1.2): loss -(30 - 24 + 6) / 23 / 3 = -4/23. Only completion 1 has a gradient,
    -w0 rho A / 3 = -10/23; nothing is clipped by w0 alone, nothing escapes."""
    inputs = three_completion_group()
    out = compute_loss(inputs, LossConfig(name="gepo", beta=0, gepo_clip="ratio"))
    assert out.loss.item() == pytest.approx(-4 / 23, abs=1e-6)
    grad = torch.autograd.grad(out.loss, inputs.learner_logprobs)[0]
    assert grad.flatten().tolist() == pytest.approx([-10 / 23, 0.0, 0.0], abs=1e-6)
    m = out.metrics_as_floats()
    assert m["clip_frac_pos"] == pytest.approx(1 / 3) and m["clip_frac_neg"] == pytest.approx(1 / 3)
    assert m["trust_escape_frac"] == 0 and m["clip_by_bias_frac"] == 0
    assert m["coef_pos_share"] == pytest.approx(1.0)
    assert m["is_weight_mean"] == pytest.approx((30 + 7.5 + 10) / 23 / 3, rel=1e-6)  # GEPO's weight w itself


@pytest.mark.parametrize("mode", ["mean", "sum"])
def test_gepo_ratio_clip_has_gepos_gradient_where_nothing_is_clipped(mode):
    inputs = random_batch(seed=2)
    cfg = dict(beta=0, seq_logprob_mode=mode, epsilon=1e6, epsilon_high=1e6)
    a = compute_loss(inputs, LossConfig(name="gepo", **cfg))
    b = compute_loss(inputs, LossConfig(name="gepo", gepo_clip="ratio", **cfg))
    ga = torch.autograd.grad(a.loss, inputs.learner_logprobs, retain_graph=True)[0]
    gb = torch.autograd.grad(b.loss, inputs.learner_logprobs)[0]
    assert torch.allclose(ga, gb, atol=1e-6) and float(ga.abs().sum()) > 0
    assert a.metrics["coef_net"].item() == pytest.approx(b.metrics["coef_net"].item(), abs=1e-6)


def two_token_group():
    """Two two-token completions sampled with every token at q = 0.5 (so E_q[q] = 0.5 and w = p / 0.5):
    1: A = +1, p_t = (0.65, 0.4): token ratios (1.3, 0.8), w = sqrt(0.26) / 0.5 = 1.0198 (unclipped);
    2: A = -1, p_t = (0.3, 0.7): token ratios (0.6, 1.4), w = sqrt(0.21) / 0.5 = 0.9165 (unclipped).
    Token 1 of each is past the clip range in PPO's direction (1.3 > 1.2 with A > 0, 0.6 < 0.8 with A < 0)."""
    learner = torch.log(torch.tensor([[0.65, 0.4], [0.3, 0.7]])).requires_grad_()
    sampler = torch.log(torch.full((2, 2), 0.5))
    return LossInputs(learner, sampler, torch.ones(2, 2), torch.tensor([1.0, -1.0]), torch.tensor([0, 0]))


def test_gepo_token_clip_drops_the_tokens_past_the_range_hand_computed():
    w1, w2 = math.sqrt(0.26) / 0.5, math.sqrt(0.21) / 0.5
    paper_inputs, token_inputs = two_token_group(), two_token_group()
    paper = compute_loss(paper_inputs, LossConfig(name="gepo", beta=0, gepo_clip="weight"))
    token = compute_loss(token_inputs, LossConfig(name="gepo", beta=0, gepo_clip="weight+token"))
    # the same value, -(w1 - w2) / 2; the gradient of -(w_i A_i mean_t l_it) / 2 is -w_i A_i / 4 per token
    assert paper.loss.item() == pytest.approx(-(w1 - w2) / 2, abs=1e-6)
    assert token.loss.item() == pytest.approx(paper.loss.item(), abs=1e-7)
    g_paper = torch.autograd.grad(paper.loss, paper_inputs.learner_logprobs)[0]
    g_token = torch.autograd.grad(token.loss, token_inputs.learner_logprobs)[0]
    assert g_paper.tolist() == [pytest.approx([-w1 / 4, -w1 / 4], abs=1e-6), pytest.approx([w2 / 4, w2 / 4], abs=1e-6)]
    assert g_token.tolist() == [pytest.approx([0.0, -w1 / 4], abs=1e-6), pytest.approx([0.0, w2 / 4], abs=1e-6)]
    m = paper.metrics_as_floats()
    assert m["clip_frac"] == 0
    assert m["token_escape_frac"] == pytest.approx(0.5)
    assert m["token_escape_pos"] == pytest.approx(0.25) and m["token_escape_neg"] == pytest.approx(0.25)
    # on negative-advantage tokens only: completion 1 keeps both tokens' gradient
    neg_inputs = two_token_group()
    neg = compute_loss(neg_inputs, LossConfig(name="gepo", beta=0, gepo_clip="weight+token-neg"))
    g_neg = torch.autograd.grad(neg.loss, neg_inputs.learner_logprobs)[0]
    assert g_neg.tolist() == [pytest.approx([-w1 / 4, -w1 / 4], abs=1e-6), pytest.approx([0.0, w2 / 4], abs=1e-6)]
    # the token-clipped loss's coefficient shares are those of the tokens that keep a gradient
    t = token.metrics_as_floats()
    assert t["coef_pos_share"] == pytest.approx(w1 / (w1 + w2), rel=1e-5)
    assert t["coef_net"] == pytest.approx((w1 - w2) / (w1 + w2), rel=1e-5)


def test_grpo_and_gspo_sign_split_hand_computed():
    """Token ratio (= sequence ratio here) rho = (1, 0.5, 2): 2 is clipped (A < 0, rho < 0.8), 3 is
    clipped (A > 0, rho > 1.2), 1 pushes up with coefficient 1 * 1."""
    for name in ("grpo", "gspo"):
        cfg = LossConfig(name=name, beta=0, epsilon=0.2, epsilon_high=0.2)
        m = compute_loss(three_completion_group(), cfg).metrics_as_floats()
        assert m["clip_frac_pos"] == pytest.approx(1 / 3) and m["clip_frac_neg"] == pytest.approx(1 / 3), name
        assert m["coef_pos_share"] == pytest.approx(1.0) and m["coef_net"] == pytest.approx(1.0), name
    # the on-policy split: every ratio 1, nothing clipped, coefficients = A: 2/4 of the mass is positive, net 0
    inputs = three_completion_group()
    on_policy = LossInputs(inputs.sampler_logprobs.clone().requires_grad_(), inputs.sampler_logprobs, inputs.mask,
                           inputs.advantages, inputs.group_ids)
    m = compute_loss(on_policy, LossConfig(name="grpo", beta=0)).metrics_as_floats()
    assert m["clip_frac_pos"] == 0 and m["clip_frac_neg"] == 0
    assert m["coef_pos_share"] == pytest.approx(0.5) and m["coef_net"] == pytest.approx(0.0, abs=1e-7)


def random_batch(seed=0, b=8, t=6):
    g = torch.Generator().manual_seed(seed)
    sampler = -torch.rand(b, t, generator=g) * 2 - 0.05
    learner = (sampler + 0.4 * torch.randn(b, t, generator=g)).clamp(max=-1e-3).requires_grad_()
    mask = torch.ones(b, t)
    mask[1, 4:] = 0
    mask[5, 2:] = 0
    adv = torch.randn(b, generator=g)
    return LossInputs(learner, sampler, mask, adv, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))


@pytest.mark.parametrize("name", ["gepo", "gspo", "grpo"])
@pytest.mark.parametrize("mode", ["mean", "sum"])
def test_coefficient_shares_are_autograds_gradient_split_by_sign(name, mode):
    """coef_pos_share and coef_net describe the gradient the loss actually has: each element's
    coefficient is minus its gradient times the number of sequences."""
    inputs = random_batch()
    cfg = LossConfig(name=name, beta=0, seq_logprob_mode=mode, **({"epsilon": 0.2, "epsilon_high": 0.2} if name == "gspo" else {}))
    out = compute_loss(inputs, cfg)
    grad = torch.autograd.grad(out.loss, inputs.learner_logprobs)[0]
    coefficient = -grad * inputs.mask
    positive = (inputs.advantages > 0)[:, None].float()
    assert float(coefficient.abs().sum()) > 0
    share = float((coefficient.abs() * positive).sum() / coefficient.abs().sum())
    net = float(coefficient.sum() / coefficient.abs().sum())
    assert out.metrics["coef_pos_share"].item() == pytest.approx(share, rel=1e-4, abs=1e-6)
    assert out.metrics["coef_net"].item() == pytest.approx(net, rel=1e-4, abs=1e-6)
    assert out.metrics["clip_frac"].item() == pytest.approx(
        (out.metrics["clip_frac_pos"] + out.metrics["clip_frac_neg"]).item(), abs=1e-6)


def test_gepo_weight_factors_multiply_to_the_weight():
    """w = rho * w0 in log space, and on-policy rho = 1: no sequence escapes, none has a log ratio."""
    inputs = random_batch(seed=1)
    learner = inputs.sampler_logprobs.mean(-1)
    sampler_seq = inputs.sampler_logprobs.mean(-1)
    log_e = torch.tensor([-0.5] * 8)
    m = gepo_weight_metrics(learner, sampler_seq, log_e, torch.zeros(8), inputs.advantages, torch.ones(8), 0.2, 0.2)
    assert m["seq_log_ratio_abs"].item() == 0 and m["trust_escape_frac"].item() == 0
    w0 = torch.exp(sampler_seq + 0.5)
    assert m["gepo_w0_mean"].item() == pytest.approx(float(w0.mean()), rel=1e-6)
    assert m["gepo_w0_adv"].item() == pytest.approx(float((w0 * inputs.advantages).mean()), rel=1e-5, abs=1e-7)


def test_sign_split_with_no_advantage_is_zero_not_nan():
    m = sign_split_metrics(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.ones(3))
    assert all(float(v) == 0 for v in m.values())


class Direct(torch.nn.Module):
    """A 'model' whose parameters are the log-probs of two one-token completions."""

    def __init__(self, logprobs):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.tensor(logprobs))


def test_step_diagnostics_hand_computed():
    """GRPO on two one-token completions, learner l = (log 0.5, log 0.45), sampler s = (log 0.5, log 0.5),
    A = (1, -1), beta = 0.1, staleness (0, 3). Ratios (1, 0.9): nothing clipped. Policy loss
    -(1 * 1 + 0.9 * -1) / 2: its gradient in l is (-0.5, 0) from A > 0 and (0, 0.45) from A < 0 (d/dl of
    -(r A)/2 = -r A / 2). k3 penalty: beta * mean(exp(s - l) - (s - l) - 1), gradient
    -beta (exp(s - l) - 1) / 2 = (0, -0.1 * (1/9) / 2)."""
    model = Direct([[math.log(0.5)], [math.log(0.45)]])
    state = {}
    diag = StepDiagnostics(model, LossConfig(name="grpo", beta=0.1), state)
    sampler = torch.tensor([[math.log(0.5)], [math.log(0.5)]])
    inputs = LossInputs(model.theta, sampler, torch.ones(2, 1), torch.tensor([1.0, -1.0]), torch.tensor([0, 0]))
    diag.micro_batch(inputs, torch.tensor([0, 3]), "key")
    out = compute_loss(inputs, LossConfig(name="grpo", beta=0.1))
    out.loss.backward()
    diag.before_update()
    with torch.no_grad():
        model.theta -= 0.1 * model.theta.grad  # a plain SGD step
    new = model.theta.detach().clone()
    m = diag.finish(lambda key: new)
    assert m["grad_norm_pos"] == pytest.approx(0.5, rel=1e-5)
    assert m["grad_norm_neg"] == pytest.approx(0.45, rel=1e-5)
    assert m["grad_norm_kl"] == pytest.approx(0.1 / 9 / 2, rel=1e-4)
    assert m["grad_cos_pos_neg"] == pytest.approx(0.0, abs=1e-7)  # different coordinates
    assert math.isnan(m["grad_cos_prev"]) and math.isnan(m["update_cos_prev"])  # no previous step
    total = torch.tensor([-0.5, 0.45 - 0.1 / 18])
    assert m["update_norm"] == pytest.approx(0.1 * float(total.norm()), rel=1e-5)
    delta = -0.1 * total  # the step's change of each completion's log-prob
    assert m["step_logprob_change_pos"] == pytest.approx(float(delta[0]), rel=1e-5)
    assert m["step_logprob_change_neg"] == pytest.approx(float(delta[1]), rel=1e-5)
    assert m["step_logprob_change"] == pytest.approx(float(delta.mean()), rel=1e-5)
    assert m["step_kl"] == pytest.approx(float((delta.exp() * delta).mean()), rel=1e-5)
    assert m["step_kl_k3"] == pytest.approx(float(((-delta).exp() - 1 + delta).mean()), rel=1e-4)
    assert m["learner_logprob_mean"] == pytest.approx((math.log(0.5) + math.log(0.45)) / 2, rel=1e-6)
    # KL(p || q) by staleness: r log r with r = 1 at staleness 0 and 0.9 at staleness 3
    assert m["kl_by_staleness"]["0"] == (pytest.approx(0.0, abs=1e-7), 1.0)
    assert m["kl_by_staleness"]["3"][0] == pytest.approx(0.9 * math.log(0.9), rel=1e-5)
    # a second step in the same direction: cosines with the previous step are 1
    diag2 = StepDiagnostics(model, LossConfig(name="grpo", beta=0.0), state)
    model.theta.grad = None
    inputs2 = LossInputs(model.theta, sampler, torch.ones(2, 1), torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    diag2.micro_batch(inputs2, torch.tensor([0, 0]), "key")
    compute_loss(inputs2, LossConfig(name="grpo", beta=0.0)).loss.backward()
    diag2.before_update()
    with torch.no_grad():
        model.theta -= 0.1 * model.theta.grad
    m2 = diag2.finish(lambda key: model.theta.detach())
    assert m2["grad_norm_neg"] == 0 and m2["grad_norm_kl"] == 0
    expected_cos = float(-total[0] / total.norm())  # the new gradient has only a first coordinate, negative like total[0]
    assert m2["grad_cos_prev"] == pytest.approx(expected_cos, rel=1e-5)
    assert m2["update_cos_prev"] == pytest.approx(expected_cos, rel=1e-5)


def test_learner_step_with_diagnostics_takes_the_same_step():
    """Switching the diagnostics on adds metrics and changes nothing else."""
    from swarm.model.loading import load_policy
    from swarm.rollouts import RolloutGroup
    from swarm.training import LearnerCore

    torch.manual_seed(0)
    model, tokenizer = load_policy("embedded")
    groups = [RolloutGroup(problem_id=f"p{i}", prompt_ids=[5 + i, 6, 7, 8], completion_ids=[[9, 10, 11], [12, 13], [14], [15, 16]],
                           sampler_logprobs=[[-1.0, -2.0, -0.5], [-1.5, -0.7], [-2.0], [-0.3, -0.9]],
                           rewards=[1.0, 0.0, 1.0, 0.0], version=i % 2, sampler_id="s") for i in range(3)]
    results = []
    for on in (False, True):
        learner = copy.deepcopy(model)
        core = LearnerCore(learner, tokenizer.pad_token_id, lr_warmup_steps=0, version=2)
        core.step_diagnostics = on
        metrics = core.step(copy.deepcopy(groups))
        results.append((metrics, torch.cat([p.detach().flatten() for p in learner.parameters()])))
    (plain, after_plain), (diagnosed, after_diagnosed) = results
    assert torch.equal(after_plain, after_diagnosed)
    assert "grad_norm_pos" not in plain and diagnosed["grad_norm_pos"] > 0 and "grad_norm_neg" in diagnosed
    assert set(diagnosed["kl_by_staleness"]) == {"1", "2"}  # versions 0 and 1 seen from version 2
    assert diagnosed["update_norm"] > 0 and diagnosed["step_kl"] >= -1e-6
    def same(a, b):
        return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))

    assert all(same(diagnosed[k], v) for k, v in plain.items() if k != "optimizer_seconds")


@pytest.mark.parametrize("clip", ["weight+token", "weight+token-neg"])
def test_gepo_token_clips_change_nothing_on_policy(clip):
    """With p = q every token ratio is 1, inside any clip range: the token-level clips drop nothing, and
    the loss and its gradient are the paper's GEPO exactly (staleness 0 trains the same)."""
    batch = random_batch(seed=3)
    learner = batch.sampler_logprobs.clone().requires_grad_()
    inputs = LossInputs(learner, batch.sampler_logprobs, batch.mask, batch.advantages, batch.group_ids)
    paper = compute_loss(inputs, LossConfig(name="gepo", gepo_clip="weight"))
    token = compute_loss(inputs, LossConfig(name="gepo", gepo_clip=clip))
    assert token.loss.item() == paper.loss.item()
    g_paper = torch.autograd.grad(paper.loss, learner, retain_graph=True)[0]
    g_token = torch.autograd.grad(token.loss, learner)[0]
    assert torch.equal(g_paper, g_token)
