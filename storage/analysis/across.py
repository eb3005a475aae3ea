"""One table over several runs: :func:`frame` (``hookline.storage.frame``)."""

from __future__ import annotations

import os
from contextlib import ExitStack
from typing import Any, Iterable, Mapping

from ..errors import InvalidArgumentError
from ..reader import Run, open_run
from .frames import Rows, check_found, names_of, select, wanted

__all__ = ["frame"]


def _labelled(runs: Any) -> list[tuple[str, Any]]:
    """``(label, run or path)`` for each run of ``runs``: a mapping's keys, else the path or URI
    the run was given as (``Run.path`` for an opened run).

    Raises:
        InvalidArgumentError: ``runs`` is not a run, a path, a mapping or an iterable of them, or
            two runs have one label.
    """
    if isinstance(runs, (str, os.PathLike, Run)):
        runs = [runs]
    if isinstance(runs, Mapping):
        pairs = [(str(k), v) for k, v in runs.items()]
    elif isinstance(runs, Iterable):
        pairs = [(r.path if isinstance(r, Run) else os.fspath(r) if isinstance(r, (str, os.PathLike)) else None, r)
                 for r in runs]
    else:
        pairs = [(None, runs)]
    for label, r in pairs:
        if label is None or not isinstance(r, (str, os.PathLike, Run)):
            raise InvalidArgumentError(
                f"frame() takes runs as paths, 'runs:/<id>' URIs or opened runs (or a dict label -> run), "
                f"got {r!r:.100}")
    labels = [label for label, _ in pairs]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise InvalidArgumentError(f"frame(): two runs are labelled {twice[0]!r}; pass a dict label -> run "
                                   f"to name them apart")
    return pairs


def frame(runs: Any, handles: str | Iterable[str] | None = None, fields: str | Iterable[str] | None = None,
          *, tracking_uri: str | None = None, cache_dir: str | os.PathLike[str] | None = None) -> Any:
    """One table of the record index of several runs: :meth:`Run.frame` of each, plus a ``run``
    column. Reads no tensor data. Needs ``pip install "hookline[analysis]"`` (pandas).

    Args:
        runs: run directories, ``runs:/<id>`` URIs, opened :class:`Run` objects, or a mapping
            label -> any of these (the labels become the ``run`` column; else the path or URI).
        handles: handle ids (None: every handle of every run); a run without one of them
            contributes no rows for it.
        fields: field names (None: every field); as ``handles``.
        tracking_uri, cache_dir: as :func:`open_run`, for ``runs:/`` URIs.

    Returns:
        A ``pandas.DataFrame``: ``run``, ``handle``, ``module``, ``field`` (categoricals),
        ``step``, ``call``, ``rank`` (int64, -1 when not distributed), ``norm`` (float64, the
        stored L2 norm; NaN for int/bool fields) and, for ``mode="stats"`` handles, ``mean``,
        ``std``, ``min``, ``max``, ``absmax``.

    Raises:
        UnknownNameError: a handle id or field name found in none of the runs.
        InvalidArgumentError: ``runs`` or a filter of the wrong kind.

    Example:
        >>> df = frame({"a": "runs/a", "b": "runs/b"}, fields="outputs.0")
        >>> df.groupby(["run", "module"], observed=True)["norm"].mean()
    """
    pairs = _labelled(runs)
    hs, fs = wanted("handles", handles, "frame()"), wanted("fields", fields, "frame()")
    rows = Rows(("run", "handle", "module", "field"))
    known_h: set[str] = set()
    known_f: set[str] = set()
    with ExitStack() as stack:
        for label, r in pairs:
            if not isinstance(r, Run):  # (opened here, closed here)
                r = stack.enter_context(open_run(r, tracking_uri=tracking_uri, cache_dir=cache_dir))
            known_h.update(r.handles)
            known_f.update(n for h in (r.handles if hs is None else [h for h in hs if h in r])
                           for n in names_of(r[h]))
            rows.extend((label,), select(r, hs, fs))
    where = f"runs {[label for label, _ in pairs]!r:.200}"
    check_found("handles", hs, known_h, where, known_h)
    check_found("fields", fs, known_f, where, known_f)
    return rows.frame()
