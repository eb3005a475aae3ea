"""Gradient-norm trajectories of every layer across several runs, saved as a PNG.

Needs only numpy, matplotlib and hookline.storage (no torch).

    python docs/examples/grad_norm_trajectories.py grad_norms.png RUN [RUN ...]
    python docs/examples/grad_norm_trajectories.py out.png runs/a runs/b --field grad_in.0 --prefix 'grads[fc'

One panel per gradient handle (ids starting with ``grads[`` by default), one line per run: the L2 norm of the
field's record at every recorded step (several calls in one step are summed in quadrature). The
norms come from ``Field.norms()``, which streams the records.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from hookline.storage import open_run


def trajectories(runs: list[str], prefix: str = "grads[", field: str = "grad_out.0") -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """``{handle: {run: (steps, norms)}}`` for every handle whose id starts with ``prefix``."""
    out: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    for r in runs:
        run = open_run(r)
        for h in run.handles:
            if not h.startswith(prefix) or field not in run[h].fields:
                continue
            f = run[h][field]
            steps = np.asarray(f.steps)
            norms = np.asarray(f.norms(), np.float64)
            uniq = np.unique(steps)
            per_step = np.array([math.sqrt(float(np.sum(norms[steps == s] ** 2))) for s in uniq])
            out.setdefault(h, {})[r] = (uniq, per_step)
    return out


def figure(data: dict, field: str):
    """The figure: one panel per handle, the per-step norm of ``field`` of each run over the steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(data))
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.5 * nrows), squeeze=False)
    for ax, (h, by_run) in zip(axes.ravel(), sorted(data.items())):
        for r, (steps, norms) in by_run.items():
            ax.plot(steps, norms, marker="o", markersize=3, label=Path(r).name or r)
        ax.set_title(f"{h}  ·  ||{field}||", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(f"L2 norm of {field} (log scale)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes.ravel()[len(data):]:
        ax.set_visible(False)
    fig.suptitle("gradient-norm trajectories", fontsize=11)
    fig.tight_layout()
    return fig


def plot(data: dict, out: str | Path, field: str) -> Path:
    """Write :func:`figure` to ``out`` (PNG)."""
    import matplotlib.pyplot as plt

    fig = figure(data, field)
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="PNG to write")
    p.add_argument("runs", nargs="+", help="run directories (or runs:/<id> URIs)")
    p.add_argument("--field", default="grad_out.0")
    p.add_argument("--prefix", default="grads[", help="handle id prefix (default: 'grads[')")
    args = p.parse_args(argv)
    data = trajectories(args.runs, args.prefix, args.field)
    if not data:
        sys.exit(f"no handle starting with {args.prefix!r} with field {args.field!r} in {args.runs}")
    for h, by_run in sorted(data.items()):
        for r, (steps, norms) in by_run.items():
            print(f"{h:<20} {r}: {len(steps)} steps, |grad| first {norms[0]:.4g} last {norms[-1]:.4g} max {norms.max():.4g}")
    path = plot(data, args.out, args.field)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main(sys.argv[1:])
