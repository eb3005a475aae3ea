"""Linear CKA similarity of one layer's features across two runs, per common step.

Needs only numpy and hookline.storage (no torch): run it on an analysis machine.

    python docs/examples/cka_two_runs.py RUN_A RUN_B 'outputs[fc2]'
    python docs/examples/cka_two_runs.py RUN_A RUN_B 'outputs[fc2]' --field outputs.0

RUN_A/RUN_B are run directories (or runs:/<id> URIs). The records of the field must hold
features of the *same inputs* in both runs (e.g. ``hookline demo``'s two runs, which see the same
data stream), shaped ``(batch, ...)``: every record is flattened to ``(batch, features)``.

Linear CKA (Kornblith et al., 2019) compares representations up to rotation and scale:
``CKA(X, Y) = ||Yc^T Xc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F)`` with column-centred ``Xc, Yc``.
1.0 means the two layers represent the batch identically (up to an orthogonal map and scale).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from hookline.storage import open_run


def linear_cka(x: np.ndarray, y: np.ndarray) -> float:
    """Linear CKA of two feature matrices ``(n, p)`` and ``(n, q)`` over the same ``n`` inputs."""
    x = np.asarray(x, np.float64).reshape(len(x), -1)
    y = np.asarray(y, np.float64).reshape(len(y), -1)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"CKA needs the same number of inputs in both runs, got {x.shape[0]} and {y.shape[0]}")
    x = x - x.mean(axis=0)
    y = y - y.mean(axis=0)
    cross = np.linalg.norm(y.T @ x) ** 2  # Frobenius norm
    denom = np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)
    return float(cross / denom) if denom > 0 else float("nan")


def cka_per_step(run_a: str, run_b: str, handle: str, field: str | None = None) -> list[tuple[int, int, float]]:
    """``(step, call, cka)`` for every ``(step, call)`` recorded in both runs."""
    ha, hb = open_run(run_a)[handle], open_run(run_b)[handle]
    if field is None:
        field = sorted(ha.fields)[0]
    fa, fb = ha[field], hb[field]
    index_b = {(int(s), int(c)): j for j, (s, c) in enumerate(zip(fb.steps, fb.calls))}
    out = []
    for i, (s, c) in enumerate(zip(fa.steps, fa.calls)):  # one record at a time: bounded memory
        j = index_b.get((int(s), int(c)))
        if j is not None:
            out.append((int(s), int(c), linear_cka(fa[i], fb[j])))
    return out


def main(argv: list[str] | None = None) -> list[tuple[int, int, float]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_a")
    p.add_argument("run_b")
    p.add_argument("handle", help="handle id, e.g. 'outputs[fc2]'")
    p.add_argument("--field", default=None, help="field name (default: the handle's first field)")
    args = p.parse_args(argv)
    rows = cka_per_step(args.run_a, args.run_b, args.handle, args.field)
    if not rows:
        print(f"no common steps for {args.handle} in {args.run_a} and {args.run_b}")
        return rows
    print(f"linear CKA of {args.handle} between\n  A = {args.run_a}\n  B = {args.run_b}")
    print(f"{'step':>6} {'call':>4}  {'CKA':>7}")
    for s, c, v in rows:
        print(f"{s:>6} {c:>4}  {v:>7.4f}")
    vals = np.array([v for _, _, v in rows])
    print(f"mean CKA {np.nanmean(vals):.4f}, first {vals[0]:.4f}, last {vals[-1]:.4f}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
