"""Linear CKA of one layer's features across two runs, per common step and over all of them.

Needs only numpy and hookline.storage (no torch): run it on an analysis machine.

    python docs/examples/cka_two_runs.py RUN_A RUN_B 'outputs[fc2]'
    python docs/examples/cka_two_runs.py RUN_A RUN_B 'outputs[transformer.h.0.mlp]' --field outputs.0

RUN_A/RUN_B are run directories (or runs:/<id> URIs). The records of the field must hold
features of the *same inputs* in both runs (e.g. ``hookline demo``'s two runs, which see the same
data stream). Every record is a samples x features matrix: all axes but the last hold samples,
so the tokens of a ``(batch, seq, d)`` output are ``batch * seq`` samples of ``d`` features
(``--sample-dims K`` changes that). Flattening such a record to ``(batch, seq * d)`` instead
leaves a handful of samples, whose CKA is close to 1 whatever the layers compute.

Linear CKA (Kornblith et al., 2019) compares representations up to rotation and scale:
``CKA(X, Y) = ||Yc^T Xc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F)`` with column-centred ``Xc, Yc``;
hookline computes it in float64 without an n x n matrix when samples outnumber features.
"all steps" is the CKA of the samples of every common step stacked, computed streaming.
Module names that differ only by a wrapper (``model.`` under Lightning) are paired anyway.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from hookline.storage import compare_runs


def main(argv: list[str] | None = None) -> list[tuple[int, int, float]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_a")
    p.add_argument("run_b")
    p.add_argument("handle", help="handle id, e.g. 'outputs[fc2]' (as named in RUN_A)")
    p.add_argument("--field", default=None, help="field name (default: the first field compared)")
    p.add_argument("--sample-dims", type=int, default=None, help="leading record axes that hold samples")
    args = p.parse_args(argv)
    res = compare_runs(args.run_a, args.run_b, handles=args.handle, fields=args.field, metrics=["cka"],
                       sample_dims=args.sample_dims)
    compared = [r for r in res if r.ok and len(r)]
    if not compared:
        print(f"no common steps for {args.handle} in {args.run_a} and {args.run_b}: "
              + "; ".join(r.message or r.status for r in res))
        return []
    r = compared[0]
    print(f"linear CKA of {r.handle} {r.field} between\n  A = {args.run_a}\n  B = {args.run_b}")
    if res.alignment:
        print(f"  ({res.alignment})")
    print(f"{'step':>6} {'call':>4}  {'CKA':>7}")
    rows = [(int(s), int(c), float(v)) for s, c, v in zip(r.steps, r.calls, r.values["cka"])]
    for s, c, v in rows:
        print(f"{s:>6} {c:>4}  {v:>7.4f}")
    vals = np.array([v for _, _, v in rows])
    print(f"mean CKA {np.nanmean(vals):.4f}, first {vals[0]:.4f}, last {vals[-1]:.4f}, "
          f"all steps {r.overall['cka']:.4f}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
