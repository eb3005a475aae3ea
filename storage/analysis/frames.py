"""Tables of a run's record index: :func:`field_frame`, :func:`handle_frame`, :func:`run_frame`.

One row per record (per field), built from the index datasets the writer stores beside the data
(``step``, ``call``, the per-entry ``norm``): no tensor data is read. A ``mode="stats"`` handle
is the exception that proves the rule: its per-record statistics *are* its data (a few float64
scalars per record), so its table reads them and shows them as columns ``norm``, ``mean``, ``std``,
``min``, ``max``, ``absmax`` of the summarised field. Needs pandas (``hookline[analysis]``).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from ..errors import FormatError, InvalidArgumentError, UnknownNameError
from .deps import require

__all__ = ["STAT_COLUMNS", "Rows", "field_frame", "handle_frame", "run_frame", "names_of", "stored_norms"]

#: The per-record statistics of a ``mode="stats"`` handle, in column order (``<field>.<stat>``).
STAT_COLUMNS = ("norm", "mean", "std", "min", "max", "absmax")
#: Integer columns of every table.
INDEX_COLUMNS = ("step", "call", "rank")


class Rows:
    """Blocks of rows gathered before one DataFrame is built (labels repeat per block, so they
    become categoricals without a Python object per row)."""

    def __init__(self, labels: Sequence[str]) -> None:
        self.labels = tuple(labels)
        self.blocks: list[tuple[tuple[str, ...], dict[str, np.ndarray]]] = []

    def add(self, labels: Sequence[str], columns: dict[str, np.ndarray]) -> None:
        """Add the rows ``columns`` (equal lengths), labelled ``labels`` (one per label column)."""
        self.blocks.append((tuple(labels), columns))

    def extend(self, labels: Sequence[str], other: Rows) -> None:
        """Add every block of ``other``, with ``labels`` in front of its own."""
        for own, cols in other.blocks:
            self.add((*labels, *own), cols)

    def frame(self) -> Any:
        """The rows as a ``pandas.DataFrame``: label columns (categorical), then ``step``,
        ``call``, ``rank`` (int64), ``norm`` and any statistic columns (float64; NaN where a
        block has none)."""
        pd = require("pandas", "hookline's tables (frame())")
        sizes = np.array([len(c["step"]) for _, c in self.blocks], np.int64)
        data: dict[str, Any] = {}
        for k, name in enumerate(self.labels):
            values = [labels[k] for labels, _ in self.blocks]
            categories = list(dict.fromkeys(values))
            where = {v: i for i, v in enumerate(categories)}
            codes = np.repeat(np.array([where[v] for v in values], np.int64), sizes)
            data[name] = pd.Categorical.from_codes(codes, categories=categories)
        stats = [s for s in STAT_COLUMNS[1:] if any(s in c for _, c in self.blocks)]
        for name in (*INDEX_COLUMNS, "norm", *stats):
            dtype = np.int64 if name in INDEX_COLUMNS else np.float64
            parts = [c[name] if name in c else np.full(len(c["step"]), np.nan) for _, c in self.blocks]
            data[name] = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
        return pd.DataFrame(data)


def stored_norms(field: Any) -> np.ndarray:
    """float64 norm of every entry of ``field`` as the writer stored it in the index (NaN for
    int and bool fields, whose norms the writer does not store)."""
    out = [pf.stored_norms if pf.stored_norms is not None else np.full(pf.count, np.nan)
           for pf in field.pieces]
    return np.concatenate(out) if out else np.zeros(0, np.float64)


def _columns(field: Any) -> dict[str, np.ndarray]:
    """``step``, ``call``, ``rank`` and ``norm`` of every entry of ``field``."""
    ranks = field.handle.ranks
    return {"step": field.steps, "call": field.calls, "rank": ranks[field.records], "norm": stored_norms(field)}


def field_frame(field: Any) -> Any:
    """The table of :meth:`hookline.storage.Field.frame`."""
    rows = Rows(())
    rows.add((), _columns(field))
    return rows.frame()


def _stats_groups(handle: Any) -> dict[str, str]:
    """``mode="stats"`` handle: summarised field -> its ``<field>.norm`` field (empty otherwise)."""
    if not handle.meta.get("stats"):
        return {}
    names = set(handle.fields)
    return {f[: -len(".norm")]: f for f in handle.fields
            if f.endswith(".norm") and handle[f].shape == () and
            all(f"{f[: -len('.norm')]}.{s}" in names for s in STAT_COLUMNS)}


def _stats_columns(handle: Any, base: str) -> dict[str, np.ndarray]:
    """The rows of one summarised field of a ``mode="stats"`` handle: its statistics as columns."""
    norm = handle[f"{base}.norm"]
    cols = {"step": norm.steps, "call": norm.calls, "rank": handle.ranks[norm.records]}
    for s in STAT_COLUMNS:
        f = handle[f"{base}.{s}"]
        if not np.array_equal(f.records, norm.records):
            raise FormatError(f"handle {handle.id!r}: {f.name!r} and {norm.name!r} cover different records")
        cols[s] = np.asarray(f.read(), np.float64)
    return cols


def names_of(handle: Any) -> list[str]:
    """The names a handle's table shows in its ``field`` column: its fields, except that the
    fields summarising one field of a ``mode="stats"`` handle show once, under the summarised
    field's name (their ``.hist`` is a vector per record: read it with ``to_xarray()``)."""
    groups = _stats_groups(handle)
    hidden = {f"{b}.{s}" for b in groups for s in (*STAT_COLUMNS, "hist")}
    return list(groups) + [f for f in handle.fields if f not in hidden]


def handle_rows(handle: Any, fields: Iterable[str] | None) -> Rows:
    """The rows of ``handle``'s table (``fields``: only these names of :func:`names_of`)."""
    groups = _stats_groups(handle)
    rows = Rows(("field",))
    for name in names_of(handle) if fields is None else fields:
        rows.add((name,), _stats_columns(handle, name) if name in groups else _columns(handle[name]))
    return rows


def wanted(kind: str, names: str | Iterable[str] | None, where: str) -> list[str] | None:
    """``handles=`` / ``fields=`` as a list of names (None: all).

    Raises:
        InvalidArgumentError: not a string or an iterable of strings.
    """
    if names is None:
        return None
    out = [names] if isinstance(names, str) else list(names) if isinstance(names, Iterable) else None
    if out is None or not all(isinstance(n, str) for n in out):
        example = "['outputs.0']" if kind == "fields" else "['outputs[fc1]']"
        raise InvalidArgumentError(f"{where}: {kind}= must be a name or a list of names, got {names!r}; "
                                   f"e.g. {kind}={example}")
    return out


def handle_frame(handle: Any, fields: str | Iterable[str] | None = None) -> Any:
    """The table of :meth:`hookline.storage.Handle.frame`.

    Raises:
        UnknownNameError: a name in ``fields`` the handle does not have.
    """
    where = f"handle {handle.id!r}"
    names = wanted("fields", fields, where)
    known = names_of(handle)
    check_found("fields", names, set(names or ()) & set(known), where, known)
    return handle_rows(handle, names).frame()


def select(run: Any, handles: list[str] | None, fields: list[str] | None) -> Rows:
    """The rows of ``run``'s table: ``handles`` (None: all) that exist in ``run``, ``fields``
    (None: all) of each that it has. Names missing everywhere are the caller's to report."""
    rows = Rows(("handle", "module", "field"))
    for hid in run.handles if handles is None else [h for h in handles if h in run]:
        h = run[hid]
        own = names_of(h)
        names = own if fields is None else [f for f in fields if f in own]
        rows.extend((hid, h.module_name), handle_rows(h, names))
    return rows


def check_found(kind: str, asked: list[str] | None, found: set[str], where: str, known: Iterable[str]) -> None:
    """Raise :class:`UnknownNameError` for a name of ``asked`` that matched nothing.

    Raises:
        UnknownNameError: the first such name (the message lists what exists).
    """
    missing = [n for n in asked or () if n not in found]
    if missing:
        known = sorted(set(known))
        shown = ", ".join(map(repr, known[:20])) + (" ..." if len(known) > 20 else "")
        raise UnknownNameError(f"no {kind[:-1]} {missing[0]!r} in {where}; available: {shown or 'none'}")


def run_frame(run: Any, handles: str | Iterable[str] | None = None,
              fields: str | Iterable[str] | None = None) -> Any:
    """The table of :meth:`hookline.storage.Run.frame`.

    Raises:
        UnknownNameError: a handle id or field name that is in no (selected) handle of the run.
    """
    where = f"run {run.path!r}"
    hs, fs = wanted("handles", handles, where), wanted("fields", fields, where)
    check_found("handles", hs, {h for h in hs or () if h in run}, where, run.handles)
    rows = select(run, hs, fs)
    check_found("fields", fs, {labels[2] for labels, _ in rows.blocks}, where,
                (n for h in (hs or run.handles) for n in names_of(run[h])))
    return rows.frame()
