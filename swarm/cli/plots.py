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


# The panels `swarm plot` draws, each the steps.jsonl keys on it; a panel none of whose keys the run
# recorded is left out (the in-process trainer and the learner write the same names).
PANELS = (
    ("reward", ("reward_mean", "accuracy")),
    ("loss", ("loss", "policy_loss", "kl_penalty")),
    ("KL", ("kl_sampler_learner", "kl_learner_sampler")),
    ("staleness (steps)", ("staleness_mean", "staleness_max")),
    ("importance weights", ("is_weight_var", "clip_frac")),
    ("gradient norm", ("grad_norm",)),
    ("groups per step", ("groups",)),
    ("seconds per step", ("seconds",)),
)


def plot_steps(records: list[dict], path: Path, title: str = "", evals: list[dict] | None = None) -> Path:
    """A grid of the run's curves over its steps.jsonl `records` (learner or in-process trainer),
    held-out pass@1 on the reward panel when `evals` (a demo's evals.json) are given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in records)]) for name, keys in PANELS]
    panels = [(name, keys) for name, keys in panels if keys]
    cols = min(4, max(1, len(panels)))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (name, keys) in zip(axes.flat, panels):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and "step" in r]
            ax.plot([p[0] for p in points], [p[1] for p in points], label=key, alpha=0.8)
        if name == "reward" and evals:
            ax.plot([e["step"] for e in evals], [e["pass_at_1"] for e in evals], "o-", label="held-out pass@1")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
