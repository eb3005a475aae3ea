"""Shuffled epochs of one RecordDataset, each after a raw read of the same bytes, on data that
``bench_loader.write`` left in DIR; prints ``dataset GB/s / raw GB/s`` per epoch. Run it with
another hookline first on ``PYTHONPATH`` to compare two designs on the same data, alternating:

    .venv/bin/python -c "import sys; sys.path.insert(0, 'tests/benchmarks'); import bench_loader as b; \\
        from pathlib import Path; b.write(Path('/tmp/gb1'), 1.0)"
    .venv/bin/python tests/benchmarks/bench_loader_epochs.py /tmp/gb1
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_loader as bl  # noqa: E402

from hookline.storage import RecordDataset  # noqa: E402


def main() -> None:
    root, row_bytes = Path(sys.argv[1]), 4 * bl.SHAPE[-1]
    epochs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    ds = RecordDataset(root / "run", bl.REF, shuffle=True, batch_rows=4096)
    out = []
    for _ in range(epochs):
        raw = bl.timed(bl.raw_read(root / "rows.f32", row_bytes), row_bytes, 60)[1]
        out.append(f"{bl.timed(bl.dataset_batches(ds), row_bytes, 60)[1]:.2f}/{raw:.2f}")
    print(" ".join(out))


if __name__ == "__main__":
    main()
