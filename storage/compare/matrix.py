"""``similarity(runs, ...)``: per handle, the N x N matrix of a representation metric over N runs
(an ``xarray.DataArray``), each pair of runs one task on a ``dask.distributed`` client when given.

Every entry is the metric over all common records of the field (samples of every matched step
stacked: ``FieldComparison.overall``). Handles are named as in the first run; the others are
paired with it by :func:`~.align.align_handles` (wrapper prefixes, ``rename=``). A task gets run
paths and handle ids, opens the runs itself (inside the worker, on a cluster) and returns
floats: no open file is ever pickled. Needs the extra ``hookline[analysis]`` (xarray; dask's
``distributed`` for ``client=``).
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ..blocks import BLOCK_BYTES
from ..errors import InvalidArgumentError, MissingDependencyError
from ..reader import Run, open_run
from .align import align_handles
from .fields import compare_fields
from .represent import REPRESENTATION_METRICS, check_sample_dims
from .runs import RunLike, glob_to_regex

__all__ = ["similarity", "pair_values"]

#: One comparison inside a pair task: (handle name, id in run A, id in run B, field).
Item = tuple[str, str, str, str]


def _xarray() -> Any:
    try:
        import xarray
    except ImportError as e:
        raise MissingDependencyError('similarity() needs xarray: pip install "hookline[analysis]"') from e
    return xarray


def pair_values(path_a: str, path_b: str, items: Sequence[Item], metric: str, sample_dims: int | None = None,
                tracking_uri: str | None = None, block_bytes: int = BLOCK_BYTES) -> dict[str, float]:
    """One pair of runs: handle name -> the metric over all common records of its field.

    Opens both runs here (a task on a worker opens its own files); NaN for a handle whose field
    did not compare (no common steps, shapes that differ).
    """
    out: dict[str, float] = {}
    with open_run(path_a, tracking_uri=tracking_uri) as ra, open_run(path_b, tracking_uri=tracking_uri) as rb:
        for name, ida, idb, fld in items:
            ha, hb = ra[ida], rb[idb]
            if fld not in ha.fields or fld not in hb.fields:
                out[name] = float("nan")
                continue
            res = compare_fields(ha, hb, fld, handle_id=name, metrics=(metric,), sample_dims=sample_dims,
                                 block_bytes=block_bytes)
            out[name] = res.overall.get(metric, float("nan")) if res.ok else float("nan")
    return out


def _label(given: RunLike) -> str:
    return given.path if isinstance(given, Run) else os.fspath(given)


def _records(run: Run, hid: str | None, fld: str) -> bool:
    """Whether the manifests list records of ``fld`` for handle ``hid``."""
    if hid is None:
        return False
    for m in run.manifests:
        e = m["handles"].get(hid)
        if e and fld in (e.get("fields") or {}) and int(e.get("records") or 0) > 0:
            return True
    return False


def _field_of(run: Run, hid: str, field: str | None) -> str | None:
    """The field compared for a handle of the first run (None: the handle lacks ``field``).

    Raises:
        InvalidArgumentError: ``field`` is None and the handle has several fields.
    """
    names = list(run[hid].fields)
    if field is not None:
        return field if field in names else None
    if len(names) == 1:
        return names[0]
    if not names:
        return None
    raise InvalidArgumentError(f"handle {hid!r} has fields {', '.join(names)}: pass field= to choose one")


def _plan(opened: list[Run], handles: str | Iterable[str] | None, field: str | None,
          rename: Mapping[str, str] | None) -> tuple[dict[str, list[str | None]], dict[str, str]]:
    """Handle name -> its id in every run (None where absent), and -> its field."""
    first = opened[0]
    pats = [handles] if isinstance(handles, str) else list(handles or [])
    regs = [glob_to_regex(p) for p in pats]
    keys = [h for h in first.handles if not regs or any(r.fullmatch(h) for r in regs)]
    if not keys:
        raise InvalidArgumentError(f"handle pattern {', '.join(map(repr, pats))} matches no handle of the first run "
                                   f"{first.path!r}; it has {', '.join(first.handles[:8]) or '(none)'}")
    fields = {k: f for k in keys if (f := _field_of(first, k, field)) is not None}
    if not fields:
        raise InvalidArgumentError(f"no selected handle of the first run has field {field!r}; "
                                   f"fields of {keys[0]!r}: {', '.join(first[keys[0]].fields) or '(none)'}")
    ids: dict[str, list[str | None]] = {k: [k] + [None] * (len(opened) - 1) for k in fields}
    for j, run in enumerate(opened[1:], start=1):
        al = align_handles(first, run, rename)
        for name in al.names:
            ida, idb = al.a.get(name), al.b.get(name)
            if ida in ids and idb is not None:
                ids[ida][j] = idb
    return ids, fields


def _check_args(runs: Sequence[RunLike], metric: str) -> list[str]:
    """The run labels, checked."""
    if metric not in REPRESENTATION_METRICS:
        raise InvalidArgumentError(f"similarity() metric must be one of {', '.join(REPRESENTATION_METRICS)}, "
                                   f"got {metric!r}")
    if isinstance(runs, (str, os.PathLike, Run)) or len(runs) < 2:
        raise InvalidArgumentError(f"similarity() needs a list of at least 2 runs, got {runs!r}")
    labels = [_label(r) for r in runs]
    dup = next((x for i, x in enumerate(labels) if x in labels[:i]), None)
    if dup is not None:
        raise InvalidArgumentError(f"run {dup!r} is given twice; give each run once")
    return labels


def similarity(
    runs: Sequence[RunLike],
    handles: str | Iterable[str] | None = None,
    field: str | None = None,
    metric: str = "cka",
    client: Any = None,
    *,
    sample_dims: int | None = None,
    rename: Mapping[str, str] | None = None,
    tracking_uri: str | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> dict[str, Any]:
    """Per handle, the N x N matrix of ``metric`` between N runs.

    Args:
        runs: run directories, ``runs:/<id>`` URIs or opened runs (their ``path`` is reopened
            in each task), at least two.
        handles: glob pattern(s) on the first run's handle ids (default: all of them).
        field: the field to compare (default: each handle's only field).
        metric: ``"cka"`` or ``"procrustes"``.
        client: a ``dask.distributed.Client``: each pair of runs is one task on it (its workers
            must see the run directories). ``None``: computed here, one pair after another.
        sample_dims: leading record axes that hold samples (default: all but the last).
        rename: name rules applied before pairing handles with the first run's (see
            :func:`~hookline.storage.compare.compare_runs`).
        tracking_uri: MLflow tracking URI for ``runs:/`` sources.
        block_bytes: read-block budget per run (float64 bytes).

    Returns:
        Handle name -> ``xarray.DataArray`` of dims ``("run_a", "run_b")`` (coordinates: the
        runs as given), symmetric; the diagonal is the metric of identical representations (1
        for CKA, 0 for Procrustes), NaN where a run lacks the handle or records.

    Raises:
        MissingDependencyError: xarray is not installed.
        InvalidArgumentError: fewer than two runs, a run given twice, an unknown metric, a
            pattern or field that matches nothing, a handle with several fields and no ``field``.
    """
    xr = _xarray()
    labels = _check_args(runs, metric)
    sample_dims = check_sample_dims(sample_dims)
    opened = [r if isinstance(r, Run) else open_run(r, tracking_uri=tracking_uri) for r in runs]
    try:
        ids, fields = _plan(opened, handles, field, rename)
        has = {k: [_records(run, v[i], fields[k]) for i, run in enumerate(opened)] for k, v in ids.items()}
    finally:
        for given, run in zip(runs, opened):
            if run is not given:
                run.close()
    tasks: dict[tuple[int, int], list[Item]] = {}
    for i in range(len(opened)):
        for j in range(i + 1, len(opened)):
            items = [(k, v[i], v[j], fields[k]) for k, v in ids.items() if v[i] is not None and v[j] is not None]
            if items:
                tasks[(i, j)] = items
    args = (metric, sample_dims, tracking_uri, block_bytes)
    if client is None:
        done = {ij: pair_values(labels[ij[0]], labels[ij[1]], items, *args) for ij, items in tasks.items()}
    else:
        futures = [client.submit(pair_values, labels[i], labels[j], items, *args, pure=False)
                   for (i, j), items in tasks.items()]
        done = dict(zip(tasks, client.gather(futures)))
    same = 1.0 if metric == "cka" else 0.0
    out: dict[str, Any] = {}
    for k, v in ids.items():
        mat = np.full((len(opened), len(opened)), np.nan)
        mat[np.diag_indices(len(opened))] = np.where(has[k], same, np.nan)
        for (i, j), values in done.items():
            if k in values:
                mat[i, j] = mat[j, i] = values[k]
        out[k] = xr.DataArray(mat, dims=("run_a", "run_b"), coords={"run_a": labels, "run_b": labels}, name=k,
                              attrs={"handle": k, "field": fields[k], "metric": metric})
    return out
