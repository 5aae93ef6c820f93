"""PNG plots of training runs (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def plot_run(history: list[dict], evals: list[dict], path: Path, title: str = "") -> Path:
    """Reward and held-out accuracy over steps (left), staleness mean/max (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [h["step"] for h in history]
    ax1.plot(steps, [h["reward_mean"] for h in history], color="C0", alpha=0.5, label="train reward (mean)")
    ax1.plot([e["step"] for e in evals], [e["pass_at_1"] for e in evals], "o-", color="C1", label="held-out pass@1")
    ax1.plot([e["step"] for e in evals], [e["greedy_accuracy"] for e in evals], "s--", color="C2", label="held-out greedy")
    ax1.set_xlabel("learner step")
    ax1.set_ylabel("accuracy / reward")
    ax1.set_ylim(0, 1)
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    ax2.plot(steps, [h["staleness_mean"] for h in history], label="staleness mean")
    ax2.plot(steps, [h["staleness_max"] for h in history], label="staleness max")
    ax2.set_xlabel("learner step")
    ax2.set_ylabel("steps behind the learner")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
