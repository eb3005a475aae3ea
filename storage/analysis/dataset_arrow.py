"""Recorded fields as a Hugging Face ``datasets`` directory (``datasets.load_from_disk``): one
column per field reference, aligned rows, plus the index columns ``step``, ``call``, ``rank``
and ``sample`` (``hookline export RUN --format arrow``; SPEC §14).

Rows are those of :class:`~hookline.storage.RecordDataset` without shuffling (same plan, same
block reads). A row of shape ``(d,)`` is an Arrow ``fixed_size_list`` (``datasets``
``List(Value(dtype), length=d)``), nested for more dimensions; dtypes Arrow lacks (bfloat16,
float8) are written as their exact float32 values. Needs the extra ``hookline[datasets]``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from .. import dtypes
from ..errors import InvalidArgumentError, MissingDependencyError
from ..reader import Run, open_run
from .dataset_plan import INDEX_KEYS, Plan, make_plan, parse_refs
from .dataset_read import Block, iter_blocks

__all__ = ["export_arrow", "require_datasets"]

#: Rows per Arrow record batch.
ARROW_ROWS = 65536


def require_datasets() -> tuple[Any, Any]:
    """``(datasets, pyarrow)``, imported.

    Raises:
        MissingDependencyError: either is not installed (the message names the extra).
    """
    try:
        import datasets
        import pyarrow
    except ImportError as e:
        raise MissingDependencyError(f"the Arrow export needs the 'datasets' package ({e.name} is missing): "
                                     f"pip install \"hookline[datasets]\"") from e
    return datasets, pyarrow


def _column(pa: Any, arr: np.ndarray, name: str) -> Any:
    """One block of a field as an Arrow array (fixed-size lists for the row's dimensions)."""
    vals = np.ascontiguousarray(dtypes.decode(arr, name))
    col = pa.array(vals.reshape(-1))
    for d in reversed(vals.shape[1:]):
        col = pa.FixedSizeListArray.from_arrays(col, d)
    return col


def _check(plan: Plan) -> None:
    for key, name, shape in zip(plan.keys, plan.dtype_names, plan.row_shapes):
        if dtypes.info(name).read.kind == "c":
            raise InvalidArgumentError(f"field {key!r} is {name}; Arrow has no complex type: export it with "
                                       f"--format npy or h5")
        if shape is None:
            raise InvalidArgumentError(f"field {key!r} has records of varying shape; export rows='sample' "
                                       f"(one row per sample) instead of whole records")


def export_arrow(run: str | os.PathLike[str] | Run, fields: str | Sequence[str], out: str | os.PathLike[str], *,
                 rows: str = "sample", steps: Iterable[int] | None = None,
                 sample_dims: int | Mapping[str, int] | None = None,
                 advance: Callable[[int], None] | None = None) -> int:
    """Write aligned rows of ``fields`` of ``run`` as a ``datasets.load_from_disk`` directory.

    Args:
        run: a run directory, ``runs:/`` URI, or an opened run.
        fields: ``"handle/field"`` references (as :class:`~hookline.storage.RecordDataset`).
        out: the directory to create (it must not exist; written as ``OUT.partial`` first and
            renamed when complete).
        rows, steps, sample_dims: as :class:`~hookline.storage.RecordDataset`.
        advance: called with the number of rows of each block written (progress bars).

    Returns:
        The number of rows written.

    Raises:
        MissingDependencyError: ``datasets`` (or ``pyarrow``) is not installed.
        InvalidArgumentError: ``out`` exists; a complex field; ragged whole records; as
            :class:`~hookline.storage.RecordDataset` for the references and options.

    Example:
        >>> export_arrow("runs/baseline", ["outputs[blocks.3]/outputs.0"], "acts")
        >>> datasets.load_from_disk("acts").with_format("torch")[0:8]["outputs[blocks.3]/outputs.0"].shape
        torch.Size([8, 64])
    """
    datasets, pa = require_datasets()
    dest = Path(out)
    if dest.exists():
        raise InvalidArgumentError(f"output {str(dest)!r} exists; remove it or choose another directory")
    r = open_run(run) if not isinstance(run, Run) else run
    plan = make_plan(r, parse_refs(fields, r), rows=rows, steps=steps, sample_dims=sample_dims)
    _check(plan)
    work = Path(tempfile.mkdtemp(prefix=".hookline-arrow-", dir=dest.parent))
    partial = dest.with_name(dest.name + ".partial")
    try:
        stream = work / "rows.arrow"
        n = _write_stream(pa, plan, lambda: r, stream, advance)
        info = datasets.DatasetInfo(description=json.dumps(
            {"hookline_run": str(r.path), "fields": dict(zip(plan.keys, plan.dtype_names)), "rows": plan.rows}))
        ds = datasets.Dataset.from_file(str(stream), info=info)
        shutil.rmtree(partial, ignore_errors=True)
        ds.save_to_disk(str(partial))
        del ds
        os.replace(partial, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(partial, ignore_errors=True)
        if not isinstance(run, Run):
            r.close()
    return n


def _write_stream(pa: Any, plan: Plan, opener: Callable[[], Run], path: Path,
                  advance: Callable[[int], None] | None) -> int:
    """Every row of ``plan`` in record order into one Arrow IPC stream file; the row count."""
    names = dict(zip(plan.keys, plan.dtype_names))
    writer = None
    n = 0
    units = np.arange(plan.num_units, dtype=np.int64)
    try:
        for block in iter_blocks(opener, plan, units, capacity=ARROW_ROWS, rng=None, batch_rows=ARROW_ROWS,
                                 index=True):
            batch = _batch(pa, block, names)
            if writer is None:
                writer = pa.ipc.new_stream(str(path), batch.schema)
            writer.write_batch(batch)
            rows = batch.num_rows
            n += rows
            if advance is not None:
                advance(rows)
    finally:
        if writer is not None:
            writer.close()
    return n


def _batch(pa: Any, block: Block, names: dict[str, str]) -> Any:
    """One block as an Arrow record batch: the field columns, then the index columns."""
    cols = {k: _column(pa, v, names[k]) for k, v in block.items() if k in names}
    cols.update({k: pa.array(block[k]) for k in INDEX_KEYS})
    return pa.record_batch(list(cols.values()), names=list(cols))
