"""The demo's curves: reward (per step, moving average, exact match) on top; loss, KL and entropy
below, so that what the console prints per step (the KL to the reference climbing, the entropy
falling) is visible in the picture too."""

from __future__ import annotations

from pathlib import Path

# The per-step records' keys drawn under the reward, with their axis labels ("kl" is named by the run).
TRAINING_PANELS = (("loss", "loss"), ("kl", None), ("entropy_mean", "sampler entropy (nats)"))


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (shorter at the start, so no step is dropped)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_reward_curve(
    history: list[dict], path: str | Path, *, title: str, window: int = 20, kl_name: str = "kl"
) -> Path:
    """Write ``path`` (PNG). Top: reward mean per step, its ``window``-step moving average and the
    exact-match rate. Bottom, one panel each: the mean minibatch loss, the KL metric (``kl_name``:
    ``kl_ref`` or ``approx_kl``) and the sampler's mean entropy, per step and moving average.

    Uses matplotlib's Agg backend (no display needed).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    reward = [r["reward_mean"] for r in history]
    exact = [r["exact_match"] for r in history]
    fig = plt.figure(figsize=(9, 6.5), dpi=120)
    grid = fig.add_gridspec(2, 3, height_ratios=(3, 2))
    ax = fig.add_subplot(grid[0, :])
    ax.plot(steps, reward, color="tab:blue", alpha=0.3, lw=1, label="reward mean (per step)")
    ax.plot(
        steps, moving_average(reward, window), color="tab:blue", lw=2, label=f"reward, {window}-step mean"
    )
    ax.plot(
        steps,
        moving_average(exact, window),
        color="tab:green",
        lw=1.5,
        ls="--",
        label=f"exact match, {window}-step mean",
    )
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title, fontsize=9)
    for col, (key, label) in enumerate(TRAINING_PANELS):
        values = [r[key] for r in history]
        sub = fig.add_subplot(grid[1, col])
        sub.plot(steps, values, color="tab:gray", alpha=0.35, lw=1)
        sub.plot(steps, moving_average(values, window), color="tab:red", lw=1.5)
        sub.set_title(label or kl_name, fontsize=8)
        sub.set_xlabel("GRPO step", fontsize=8)
        sub.tick_params(labelsize=7)
        sub.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
