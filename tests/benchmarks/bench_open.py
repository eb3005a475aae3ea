"""Open cost of runs with many handles (a script, not collected by pytest). Prints times measured
in one run.

    .venv/bin/python tests/benchmarks/bench_open.py [--handles 1000 100000] [--real 100]

A real run of ``--real`` handles (RunWriter, one small record each) is extended to each
``--handles`` count by copying its manifest entries under new handle ids (their files do not
exist: nothing here opens them). Measured per count, best of ``--repeats``:

* ``open_run(path)`` + ``run.handles`` in a fresh process state (the manifest cache cleared),
  per handle; the target is <= 0.2 ms per handle (issue 34);
* what that is made of: JSON parsing, and the manifest check (one pass per entry, as the reader
  does, against the key-by-key check every entry got before);
* ``hookline show RUN`` (first 50 handles listed, all summed) in-process, wall time.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from hookline.cli.main import cli
from hookline.storage import RunWriter, format as hformat, local, open_run


def real_run(d: Path, n: int) -> Path:
    run = d / "base"
    with RunWriter(run, fsync=False) as w:
        for i in range(n):
            w.add_handle(f"outputs[l{i}]", module_name=f"l{i}", category="forward_hook")
            w.write(f"outputs[l{i}]", 0, 0, {"outputs.0": np.zeros(4, np.float32)})
    return run


def extended(base: Path, d: Path, n: int) -> Path:
    run = d / f"run{n}"
    shutil.copytree(base, run)
    m = json.loads((run / "manifest.json").read_text())
    entries = list(m["handles"].values())
    handles = dict(list(m["handles"].items())[:n])
    for i in range(len(handles), n):
        e = copy.deepcopy(entries[i % len(entries)])
        e.update(key=f"outputs/x{i}", file=f"outputs/x{i}.h5", module_name=f"x{i}")
        handles[f"outputs[x{i}]"] = e
    m["handles"] = handles
    (run / "manifest.json").write_text(json.dumps(m))
    return run


def timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        local._MANIFESTS.clear()  # (each open parses the manifest, as a new process does)
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def key_by_key(m: dict) -> None:
    """The manifest check every entry got before the one-pass check (kept as its fallback)."""
    for hid, entry in m["handles"].items():
        hformat._check_values(entry, hformat._ENTRY_SCHEMA, f"handles[{hid!r}].", "bench")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--handles", type=int, nargs="+", default=[1000, 100000])
    ap.add_argument("--real", type=int, default=100, help="handles with real files (default 100)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="hookline-bench-open-"))
    try:
        base = real_run(d, args.real)
        print(f"== open cost (manifest of N handles; {args.real} with real files), best of {args.repeats}")
        for n in args.handles:
            run = extended(base, d, n)
            raw = (run / "manifest.json").read_bytes()
            m = json.loads(raw)
            t_open = timed(lambda: open_run(run).handles, args.repeats)
            t_json = timed(lambda: json.loads(raw), args.repeats)
            t_check = timed(lambda: hformat.check_manifest(m, "bench"), args.repeats)
            t_old = timed(lambda: key_by_key(m), args.repeats)
            t_show = timed(lambda: CliRunner().invoke(cli, ["show", str(run)]), 1)
            print(f"  {n:>7} handles ({len(raw) / 2**20:.1f} MiB manifest): open_run + handles {t_open:.3f} s = "
                  f"{t_open / n * 1e3:.4f} ms/handle (target <= 0.2); json {t_json:.3f} s, check {t_check:.3f} s "
                  f"(key by key: {t_old:.3f} s, {t_old / t_check:.1f}x); hookline show {t_show:.2f} s")
            shutil.rmtree(run)
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
