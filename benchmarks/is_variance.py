"""Importance-weight variance: Var_q(p/q) against Var_q(p/E_q[q]) as KL(p||q) grows.

The GEPO paper's Theorem 1: Var(p/q) - Var(p/E_q[q]) >= exp(KL(p||q)) - C, and its Figure 2 shows
both for Bernoulli and unit-variance Gaussian families. Here both are computed exactly (closed
forms below) and checked by Monte Carlo on samples drawn from q.

Bernoulli, p = Bern(a), q = Bern(b), y in {0, 1}, E_q[q] = sum_y q(y)^2:
  Var(p/q)        = sum_y p(y)^2 / q(y) - 1
  Var(p/E_q[q])   = (sum_y q p^2 - (sum_y q p)^2) / E_q[q]^2
Gaussian, p = N(a, 1), q = N(b, 1), d = a - b, KL = d^2 / 2, E_q[q] = 1 / (2 sqrt(pi)):
  Var(p/q)        = exp(d^2) - 1
  Var(p/E_q[q])   = (2 / sqrt(3)) exp(-d^2 / 3) - exp(-d^2 / 2)
"""

from __future__ import annotations

import math

import numpy as np

from benchmarks.common import RESULTS, markdown_table, write_result


def bernoulli(a: float, b: float) -> dict:
    p = np.array([1 - a, a])
    q = np.array([1 - b, b])
    eq = float((q * q).sum())
    var_pq = float((p * p / q).sum() - 1)
    var_gepo = float(((q * p * p).sum() - (q * p).sum() ** 2) / eq**2)
    kl = float((p * np.log(p / q)).sum())
    return {"a": a, "b": b, "kl": kl, "var_p_over_q": var_pq, "var_p_over_Eq": var_gepo}


def gaussian(d: float) -> dict:
    return {
        "d": d,
        "kl": d * d / 2,
        "var_p_over_q": math.expm1(d * d),
        "var_p_over_Eq": 2 / math.sqrt(3) * math.exp(-d * d / 3) - math.exp(-d * d / 2),
    }


def monte_carlo_gaussian(d: float, n: int, rng: np.random.Generator) -> tuple[float, float]:
    y = rng.normal(0.0, 1.0, n)  # q = N(0, 1), p = N(d, 1)
    log_q = -0.5 * y**2 - 0.5 * math.log(2 * math.pi)
    log_p = -0.5 * (y - d) ** 2 - 0.5 * math.log(2 * math.pi)
    w = np.exp(log_p - log_q)
    w_gepo = np.exp(log_p) * 2 * math.sqrt(math.pi)
    return float(w.var()), float(w_gepo.var())


def monte_carlo_bernoulli(a: float, b: float, n: int, rng: np.random.Generator) -> tuple[float, float]:
    y = rng.random(n) < b
    p = np.where(y, a, 1 - a)
    q = np.where(y, b, 1 - b)
    eq = b * b + (1 - b) ** 2
    return float((p / q).var()), float((p / eq).var())


def run(samples: int = 200_000) -> dict:
    rng = np.random.default_rng(0)
    bern = []
    for b in [0.5, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005, 0.002, 0.001]:
        row = bernoulli(0.9, b)
        row["mc_var_p_over_q"], row["mc_var_p_over_Eq"] = monte_carlo_bernoulli(0.9, b, samples, rng)
        bern.append(row)
    gauss = []
    for d in [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0]:
        row = gaussian(d)
        row["mc_var_p_over_q"], row["mc_var_p_over_Eq"] = monte_carlo_gaussian(d, samples, rng)
        gauss.append(row)
    plot(bern, gauss)
    md = ["# Importance-weight variance: p/q (GRPO, GSPO) vs p/E_q[q] (GEPO)\n",
          "Exact values (closed forms in benchmarks/is_variance.py) and Monte Carlo estimates from "
          f"{samples} samples of q. Plot: is_variance.png.\n",
          "\n## Bernoulli p = Bern(0.9), q = Bern(b)\n",
          markdown_table(["b", "KL(p||q)", "Var p/q", "Var p/E_q[q]", "MC Var p/q", "MC Var p/E_q[q]"],
                         [[r["b"], r["kl"], r["var_p_over_q"], r["var_p_over_Eq"], r["mc_var_p_over_q"], r["mc_var_p_over_Eq"]] for r in bern]),
          "\n## Gaussian p = N(d, 1), q = N(0, 1)\n",
          markdown_table(["d", "KL(p||q)", "Var p/q", "Var p/E_q[q]", "MC Var p/q", "MC Var p/E_q[q]"],
                         [[r["d"], r["kl"], r["var_p_over_q"], r["var_p_over_Eq"], r["mc_var_p_over_q"], r["mc_var_p_over_Eq"]] for r in gauss]),
          "\nAt large KL the Monte Carlo estimate of Var(p/q) falls below the exact value: the weight is "
          "heavy-tailed and a finite sample rarely sees the rare huge weights that carry its variance. "
          "That is the same failure, seen from the estimator's side; p/E_q[q] has no such tail.\n"]
    write_result("is_variance", {"bernoulli": bern, "gaussian": gauss, "samples": samples}, "".join(md))
    return {"bernoulli": bern, "gaussian": gauss}


def plot(bern: list[dict], gauss: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, rows, title in ((axes[0], bern, "Bernoulli: p=Bern(0.9), q=Bern(b)"), (axes[1], gauss, "Gaussian: p=N(d,1), q=N(0,1)")):
        kl = [r["kl"] for r in rows]
        ax.plot(kl, [r["var_p_over_q"] for r in rows], "o-", label="Var(p/q)  (GRPO/GSPO)")
        ax.plot(kl, [r["var_p_over_Eq"] for r in rows], "s-", label="Var(p/E_q[q])  (GEPO)")
        ax.plot(kl, [r["mc_var_p_over_q"] for r in rows], "x", color="C0", alpha=0.6, label="Monte Carlo")
        ax.plot(kl, [r["mc_var_p_over_Eq"] for r in rows], "x", color="C1", alpha=0.6)
        ax.set_yscale("symlog", linthresh=1e-2)
        ax.set_xlabel("KL(p || q)")
        ax.set_ylabel("variance of the importance weight")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(RESULTS / "is_variance.png", dpi=120)
    plt.close(fig)
