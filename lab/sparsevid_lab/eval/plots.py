"""Figures of :func:`~sparsevid_lab.eval.suite.run_suite` results (matplotlib, Agg backend): quality against
sparsity per rule, oracle against predicted recall, and recall per layer."""
from __future__ import annotations

from pathlib import Path

from sparsevid.training.plots import pyplot, save_figure

RULE_COLOURS = {"topk": "tab:blue", "topp": "tab:orange", "hybrid": "tab:green"}


def _by_rule(results: dict, value) -> dict[str, list[tuple[float, float]]]:
    """{rule: [(sparsity, value(entry)), ...] sorted by sparsity} over the configurations (None values skipped)."""
    points: dict[str, list[tuple[float, float]]] = {}
    for entry in results["configs"].values():
        y = value(entry)
        if y is not None:
            points.setdefault(entry["config"]["rule"], []).append((entry["sparsity"], y))
    return {rule: sorted(p) for rule, p in points.items()}


def plot_quality(results: dict, path: str | Path) -> Path:
    """PSNR against dense (with the noise floor), velocity error and caption faithfulness (with dense's)
    against achieved sparsity, one line per rule."""
    plt = pyplot()
    faith = lambda e: e["faithfulness"]["overall"]  # noqa: E731
    panels = [("PSNR vs dense (dB)", lambda e: e["psnr"], results["noise_floor_psnr"], "noise floor"),
              ("velocity error (rel. L2)", lambda e: e["velocity_error"]["overall"],
               results["noise_floor"]["velocity_error"]["overall"], "every tile kept"),
              ("caption faithfulness", faith, faith(results["dense"]), "dense")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), dpi=120)
    for ax, (ylabel, value, level, level_label) in zip(axes, panels):
        for rule, points in _by_rule(results, value).items():
            ax.plot(*zip(*points), "o-", color=RULE_COLOURS.get(rule), label=rule)
        ax.axhline(level, color="gray", ls="--", lw=1, label=level_label)
        ax.set_xlabel("achieved sparsity")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def plot_recall(results: dict, path: str | Path) -> Path:
    """Oracle recall (mean over layers and probed steps) against sparsity, and each configuration's predicted
    recall (filled) with its oracle at the same per-row tile counts (hollow)."""
    plt = pyplot()
    oracle = results["oracle"]
    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=120)
    ax.plot(oracle["oracle"]["achieved_sparsity"], oracle["oracle"]["recall_mean"], "k-", marker="s", label="oracle")
    for name, p in oracle["predicted"].items():
        colour = RULE_COLOURS.get(results["configs"][name]["config"]["rule"])
        ax.plot([p["sparsity_mean"]], [p["recall_mean"]], "o", color=colour)
        ax.plot([p["sparsity_mean"]], [p["oracle_recall_mean"]], "o", mfc="none", color=colour)
    for rule, colour in RULE_COLOURS.items():
        ax.plot([], [], "o", color=colour, label=f"{rule} predicted (hollow: oracle at its counts)")
    ax.set_xlabel("sparsity")
    ax.set_ylabel("attention recall")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def plot_recall_per_layer(results: dict, path: str | Path) -> Path:
    """Per layer: the oracle recall at every grid sparsity (solid) and each configuration's predicted recall
    (dashed)."""
    plt = pyplot()
    oracle = results["oracle"]
    layers = oracle["layers"]
    fig, ax = plt.subplots(figsize=(6, 3.8), dpi=120)
    for i, x in enumerate(oracle["sparsities"]):
        ax.plot(layers, [row[i] for row in oracle["oracle"]["recall_per_layer"]], "-", marker="s",
                color=plt.cm.viridis(i / max(1, len(oracle["sparsities"]) - 1)), label=f"oracle {x:.0%}")
    for name, p in oracle["predicted"].items():
        ax.plot(layers, p["recall_per_layer"], "--", marker="o", ms=3,
                color=RULE_COLOURS.get(results["configs"][name]["config"]["rule"]), alpha=0.7, lw=0.9)
    for rule, colour in RULE_COLOURS.items():
        ax.plot([], [], "--", color=colour, label=f"{rule} predicted")
    ax.set_xlabel("layer")
    ax.set_ylabel("attention recall")
    ax.set_xticks(layers)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    return save_figure(fig, path)


def plot_suite(results: dict, out: str | Path) -> list[Path]:
    """Every figure of ``results`` into directory ``out``; returns the paths."""
    out = Path(out)
    paths = [plot_quality(results, out / "quality_vs_sparsity.png")]
    if results.get("oracle") is not None:
        paths += [plot_recall(results, out / "recall_vs_sparsity.png"),
                  plot_recall_per_layer(results, out / "recall_per_layer.png")]
    return paths
