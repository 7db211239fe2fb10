"""The demo's reward curve: mean reward per step, its moving average and the exact-match rate."""

from __future__ import annotations

from pathlib import Path


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (shorter at the start, so no step is dropped)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_reward_curve(history: list[dict], path: str | Path, *, title: str, window: int = 20) -> Path:
    """Write ``path`` (PNG): reward mean per step, its ``window``-step moving average, exact match.

    Uses matplotlib's Agg backend (no display needed).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    reward = [r["reward_mean"] for r in history]
    exact = [r["exact_match"] for r in history]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
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
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
