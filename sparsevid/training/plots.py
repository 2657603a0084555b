"""Figures written to files (matplotlib on the Agg backend, an optional dependency): the loss curve of a run."""
from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (figures written to files, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path) -> Path:
    """Write ``fig`` (tight layout) to ``path`` (folders created) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    pyplot().close(fig)
    return path


def plot_loss(history: list[dict], path: str | Path, title: str = "training loss",
              ylabel: str = "flow-matching loss (MSE)") -> Path:
    """Draw loss against step from ``history`` rows with "step" and "loss" into a PNG (log scale when every loss is
    positive)."""
    if not history:
        raise ValueError("history is empty")
    losses = [r["loss"] for r in history]
    fig, ax = pyplot().subplots(figsize=(6, 3.5), dpi=120)
    ax.plot([r["step"] for r in history], losses, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if min(losses) > 0:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)
