"""Comparison plots (matplotlib, Agg backend): one panel per handle, metrics over steps."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

__all__ = ["plot_comparison"]

_METRIC_STYLE = {
    "cosine": {"color": "#1f77b4", "label": "cosine"},
    "rel_l2": {"color": "#d62728", "label": "rel_l2 = ||a-b|| / ||a||"},
    "norm_ratio": {"color": "#2ca02c", "label": "norm_ratio = ||b|| / ||a||"},
}
_FIELD_STYLES = ["-", "--", ":", "-."]
_MARKERS = ["o", "s", "^", "D"]


def _x(steps: np.ndarray, calls: np.ndarray) -> np.ndarray:
    """x positions: the step, with several calls of one step spread within it."""
    x = steps.astype(float)
    if calls.size and calls.max() > 0:
        ncalls = calls.max() + 1
        x = x + calls / (ncalls + 1)
    return x


def plot_comparison(
    results: Sequence[Any],
    out: str | Path,
    *,
    metrics: Sequence[str],
    title: str | None = None,
    label_a: str = "A",
    label_b: str = "B",
    max_panels: int = 24,
) -> Path:
    """Write a PNG with one panel per handle; in each, every selected metric over the common
    steps (one line per field). Returns the path written."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    out = Path(out)
    by_handle: dict[str, list[Any]] = {}
    for r in results:
        if r.status == "ok" and len(r.steps):
            by_handle.setdefault(r.handle, []).append(r)
    handles = list(by_handle)[:max_panels]
    n = max(1, len(handles))
    ncols = 1 if n == 1 else 2 if n in (2, 4) else 3
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(5.2 * ncols, 3.4 * nrows + 0.9), squeeze=False, sharex=True
    )
    flat = axes.ravel()
    legend: dict[str, Any] = {}
    for ax, h in zip(flat, handles):
        fields = by_handle[h]
        for fi, r in enumerate(fields):
            x = _x(r.steps, r.calls)
            for m in metrics:
                y = r.values.get(m)
                if y is None:
                    continue
                style = _METRIC_STYLE[m]
                (line,) = ax.plot(
                    x, y, _FIELD_STYLES[fi % len(_FIELD_STYLES)], color=style["color"],
                    marker=_MARKERS[fi % len(_MARKERS)], markersize=3, linewidth=1.6,
                )
                key = style["label"] + (f"  [{r.field}]" if len(fields) > 1 else "")
                legend.setdefault(key, line)
        ax.set_title(h if len(fields) > 1 else f"{h}  ·  {fields[0].field}", fontsize=10)
        ax.grid(True, alpha=0.3)
        if "cosine" in metrics:
            ax.axhline(1.0, color="#999999", linewidth=0.8, zorder=0)
        if "rel_l2" in metrics and len(metrics) == 1:
            ax.axhline(0.0, color="#999999", linewidth=0.8, zorder=0)
    for ax in flat[len(handles):]:
        ax.set_visible(False)
    if not handles:
        flat[0].set_visible(True)
        flat[0].text(0.5, 0.5, "nothing to plot: no handle has common steps", ha="center", va="center",
                     transform=flat[0].transAxes)
        flat[0].set_axis_off()
    for ax in axes[-1]:
        ax.set_xlabel("step")
    for row in axes:
        row[0].set_ylabel(metrics[0] if len(metrics) == 1 else "value")
    head = title or f"{label_a}  vs  {label_b}"
    fig.suptitle(head, fontsize=11)
    if legend:
        fig.legend(list(legend.values()), list(legend.keys()), loc="lower center",
                   ncol=min(3, len(legend)), fontsize=9, frameon=False)
    bottom = 0.9 / (3.4 * nrows + 0.9) + (0.03 if len(legend) > 3 else 0.0)
    fig.tight_layout(rect=(0, bottom + 0.02, 1, 0.95))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
