"""Lazy reader of hookline runs: :func:`open_run` -> :class:`Run` -> :class:`Handle` -> :class:`Field`.

Needs only numpy and h5py. Files are opened read-only with no chunk cache (``rdcc_nbytes=0``), so
reading one record reads only that record's bytes. Runs whose writer was killed are read as they
are: the complete files (final ``.h5`` and sealed ``.h5seg`` segments) are used, files still
being written (``.partial``) are ignored. No pickle: only HDF5 datasets and JSON are parsed.

Data comes from a *source* with two methods, so local directories and MLflow runs read alike::

    manifests() -> list[dict]        # parsed manifest JSON, one per rank
    path(rel: str) -> pathlib.Path   # local path of a file of the run (may download it)

A source may also offer ``discover(key, suffix) -> _parts.Discovery`` to list segment files
(the local source does; remote sources provide only the final files named in the manifest), and
``shared_manifests()`` with ``settled(manifest, rel)`` (:class:`~.local.LocalSource`): checked
manifests shared within the process, and whether a closed run's manifest names all of a
handle's files, so that opening a run and reading one record opens that one file and lists no
directory.

The analysis methods (``frame``, ``to_dask``, ``to_xarray``, ``to_torch()`` of many records)
delegate to :mod:`hookline.storage.analysis`.

(~745 lines, kept in one file: :class:`Run`, :class:`Handle`, :class:`LazyPart` and
:class:`Field` share private state - a Field reads its handle's opened parts and record offsets -
so splitting them would pass private names between modules.)
"""

from __future__ import annotations

import bisect
import copy
import os
import stat
import warnings
from functools import cached_property
from itertools import accumulate
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from . import dtypes
from ._fs import check_max_open_files
from ._h5read import FileLRU, Part, PartField, open_part
from .errors import FormatError, HookTypeError, InvalidArgumentError, RecordIndexError, StorageError, UnknownNameError
from .format import MANIFEST_RE, check_manifest, final_name, rank_suffix
from .identity import foreign, missing_fields
from .live import not_sealed_yet
from .local import LocalSource, names_hint
from .shards import LogicalField, logical_field
from .sources import find_source

__all__ = ["open_run", "Run", "Handle", "Field", "LocalSource"]

#: The start of the warning a handle gives when it skips damaged files (a ``warnings`` filter
#: ``message`` pattern: callers that report the damage themselves hide it).
DAMAGE_WARNING = r"hookline: skipping \d+ unreadable file"


class LazyPart:
    """A part of a handle (one complete file, of one rank) that is opened on first use.

    Once open it stays open as far as the run's :class:`FileLRU` allows (the LRU closes and
    reopens the file underneath; :attr:`part` stays valid).

    Attributes:
        source: the run's source (gives the part's local path).
        rel: the part's name relative to the run directory.
        rank: the rank it belongs to (None when not distributed).
        lru: the run's open-file bound.
        records: how many records the manifest says the file holds (None: not known).
        run_uuid: the run's identity from its manifest (a file of another run is refused).
        part: the opened :class:`Part`, or None before the first :meth:`open`.
    """

    def __init__(self, source: Any, rel: str, rank: int | None, lru: FileLRU | None = None,
                 records: int | None = None, run_uuid: Any = None):
        self.source = source
        self.rel = rel
        self.rank = rank
        self.lru = lru
        self.records = records
        self.run_uuid = run_uuid
        self.part: Part | None = None

    def open(self, handle_id: str) -> Part:
        """The opened part (opened now on first use).

        Raises:
            StorageError: the file cannot be opened (``__cause__`` is the ``OSError``).
            FormatError: the file belongs to another handle than ``handle_id``, or to another run.
        """
        if self.part is None:
            path = self.source.path(self.rel)
            try:
                part = open_part(path, self.lru)
            except OSError as e:
                raise StorageError(f"cannot open {str(path)!r} of handle {handle_id!r}: {e}") from e
            if (why := foreign(part.attrs, handle_id, self.run_uuid)) is not None:
                part.close()
                raise FormatError(f"{str(path)!r} is not a file of handle {handle_id!r} of this run: {why}")
            self.part = part
        return self.part


def _merged(m: dict[str, Any], e: dict[str, Any]) -> bool:
    """Whether manifest ``m`` says all of handle entry ``e``'s records are in its final file: the
    run closed, no segment left unmerged, the file named as the key gives it."""
    return (m.get("status") == "closed" and e.get("segments") == 0 and isinstance(e.get("records"), int)
            and e.get("file") == final_name(e["key"], rank_suffix(m.get("rank"), m.get("world_size"))))


class Run:
    """A recorded run: handles by id. Use as a context manager (or call :meth:`close`).

    Attributes:
        path: where the run was opened from.
        manifests: the parsed manifests, one per rank (a copy, made on first use).
        meta: run metadata (of the lowest rank; a copy).
        status: ``"open"``, ``"closed"``, ``"failed"`` (lowest rank's manifest).
        ranks: ranks present (``[None]`` when not distributed).
        files: the :class:`FileLRU` bounding the files open at once (``max_open_files``).
    """

    def __init__(self, source: Any, where: str = "", max_open_files: int | None = None,
                 verify_checksums: bool = False):
        capacity = check_max_open_files(max_open_files, 4, 256)
        self.source = source
        self.path = where
        shared = getattr(source, "shared_manifests", None)
        if shared is not None:  # (checked, and shared with other readers: read-only here)
            manifests = shared()
        else:
            manifests = list(source.manifests())
            checked = getattr(source, "checked", ())
            for i, m in enumerate(manifests):
                if id(m) not in checked:
                    check_manifest(m, f"{where} manifest #{i}")
        #: The manifests, lowest rank first (read-only: :attr:`manifests` gives copies).
        self._manifests: list[dict[str, Any]] = sorted(
            manifests, key=lambda m: -1 if m.get("rank") is None else m["rank"])
        first = self._manifests[0] if self._manifests else {}
        self.status: str = first.get("status", "unknown")
        self.ranks: list[int | None] = [m.get("rank") for m in self._manifests]
        self._cache: dict[tuple[str, int | None], Handle] = {}
        #: Files open at once (least recently used closed first, reopened when read again).
        self.files = FileLRU(capacity, verify_checksums)

    @cached_property
    def manifests(self) -> list[dict[str, Any]]:
        """The parsed manifests, one per rank, lowest rank first (this run's own copy)."""
        return copy.deepcopy(self._manifests)

    @cached_property
    def meta(self) -> dict[str, Any]:
        """Run metadata (of the lowest rank)."""
        return copy.deepcopy(dict(self._manifests[0].get("meta") or {})) if self._manifests else {}

    def _entries(self, handle_id: str) -> list[tuple[dict, dict]]:
        """``(manifest, entry)`` of every rank that has ``handle_id`` (none: unknown)."""
        return [(m, m["handles"][handle_id]) for m in self._manifests if handle_id in m["handles"]]

    @cached_property
    def _ids(self) -> list[str]:
        """Handle ids of all ranks, in the order they were added (made on first use: opening a
        run and reading one handle does nothing per handle)."""
        if len(self._manifests) == 1:
            return list(self._manifests[0]["handles"])
        return list(dict.fromkeys(h for m in self._manifests for h in m["handles"]))

    @property
    def handles(self) -> list[str]:
        """Handle ids, in the order they were added."""
        return list(self._ids)

    def __contains__(self, handle_id: object) -> bool:
        return any(handle_id in m["handles"] for m in self._manifests)

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, handle_id: str) -> Handle:
        return self.handle(handle_id)

    def handle(self, handle_id: str, rank: int | None = None) -> Handle:
        """The handle ``handle_id``: all ranks together (rank-major), or only ``rank``.

        Raises:
            UnknownNameError: unknown id (the message lists the available ones).
        """
        key = (handle_id, rank)
        h = self._cache.get(key)
        if h is not None:
            return h
        entries = self._entries(handle_id)
        if not entries:
            raise UnknownNameError(f"unknown handle {handle_id!r} in run {self.path!r}; available: "
                                   f"{names_hint(self.handles)}")
        if rank is not None:
            ranks = [m.get("rank") for m, _ in entries]
            entries = [(m, e) for m, e in entries if m.get("rank") == rank]
            if not entries:
                raise UnknownNameError(f"handle {handle_id!r} has no data of rank {rank!r}; ranks: {ranks}")
        h = self._cache[key] = Handle(self, handle_id, entries)
        return h

    def frame(self, handles: str | Sequence[str] | None = None, fields: str | Sequence[str] | None = None) -> Any:
        """:meth:`Handle.frame` of ``handles`` (ids; None: all) with columns ``handle`` and
        ``module`` in front; ``fields`` as there. Reads the record index only. Needs
        ``pip install "hookline[analysis]"`` (pandas)."""
        from .analysis.frames import run_frame
        return run_frame(self, handles, fields)

    def close(self) -> None:
        """Close every open file."""
        for h in self._cache.values():
            h._close()
        self._cache.clear()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Run({self.path!r}, handles={len(self)}, status={self.status!r})"


class Handle:
    """The records of one hook handle.

    Attributes:
        id: handle id (``"outputs[blocks.0]"``).
        key: file key (``"outputs/blocks.0"``).
        module_name, module_type, category, hook_fn_name: as registered.
        meta: per-handle metadata dict.
        manifest: the manifest entry (lowest rank).
    """

    def __init__(self, run: Run, handle_id: str, entries: list[tuple[dict, dict]]):
        self.run = run
        self.id = handle_id
        e0 = entries[0][1]
        self.key: str = e0.get("key", "")
        self.module_name: str = e0.get("module_name", "")
        self.module_type: str = e0.get("module_type", "")
        self.category: str = e0.get("category", "")
        self.hook_fn_name: str = e0.get("hook_fn_name", "")
        self._problems: list[str] = []
        self._entries = entries  # (the run's shared manifests: read-only)
        self._discover()
        self._loaded = False
        self._fields: dict[str, Field | LogicalField] = {}

    @cached_property
    def manifest(self) -> dict[str, Any]:
        """The handle's manifest entry (lowest rank; this handle's own copy)."""
        return copy.deepcopy(self._entries[0][1])

    @cached_property
    def meta(self) -> dict[str, Any]:
        """Per-handle metadata (a copy)."""
        return copy.deepcopy(dict(self._entries[0][1].get("meta") or {}))

    def _discover(self, quick: bool = True) -> None:
        """List the handle's parts (final file, or sealed segments of a live or killed run).

        A closed run whose manifest says every segment of the handle was merged (``quick``): its
        final file, named by the manifest, without listing the directory; :meth:`_load` lists
        after all when the file is not what the manifest says."""
        self.gaps: list[tuple[int | None, int, int]] = []
        self._listed: list[LazyPart] = []
        self._broken: list[tuple[str, str]] = []  # (file, why): complete files that did not open
        self._refused: list[str] = []  # a key leading outside the run: nothing of it is read
        run = self.run
        src = run.source
        settled = getattr(src, "settled", None)
        self._quick = (quick and settled is not None and hasattr(src, "discover")
                       and all(_merged(m, e) and settled(m, e["file"]) for m, e in self._entries))
        for m, e in self._entries:
            rank, ru = m.get("rank"), m.get("run_uuid")
            if self._quick:  # (the file name is confined when it opens: source.path)
                self._listed.append(LazyPart(src, e["file"], rank, run.files, e["records"], ru))
            elif hasattr(src, "discover"):
                try:
                    d = src.discover(e.get("key"), rank_suffix(rank, m.get("world_size")))
                except FormatError as err:  # a key leading outside the run: nothing of it is read
                    self._refused.append(f"handle {self.id!r}: {err}")
                    continue
                self.gaps.extend((rank, a, b) for a, b in d.gaps)
                self._listed.extend(LazyPart(src, f.name, rank, run.files, run_uuid=ru) for f in d.cover)
                self._broken.extend(d.broken + d.blocked)  # (still bytes on disk)
            elif e.get("records", 1) or e.get("file"):
                self._listed.append(LazyPart(src, e["file"], rank, run.files, run_uuid=ru))
        self._lazy = list(self._listed)  # the readable ones, once loaded

    # --- loading -------------------------------------------------------------------------------------
    def _load(self) -> None:
        """Open the handle's parts (once) and index their records and fields."""
        if self._loaded:
            return
        parts, lazy, errors = self._open_parts()
        if self._quick and (errors or any(p.record_start != 0 or p.n != lp.records for p, lp in zip(parts, lazy))):
            # Not the files the closed run's manifest names (missing, damaged, replaced, or more
            # files added): list the directory as for a live run, and report what it holds.
            self._close()
            self._discover(quick=False)
            parts, lazy, errors = self._open_parts()
        if any(isinstance(e.__cause__, FileNotFoundError) for e in errors):
            # A live run's writer merged or sealed files since the handle listed them (close()
            # merges segments into the final file): list again, once; not damage.
            self._close()
            self._discover()
            parts, lazy, errors = self._open_parts()
        self._lazy = lazy
        self._index(parts)
        self._report(errors, self._missing_records())

    def _missing_records(self) -> str | None:
        """A closed run's manifest counting more records than its files hold: files were deleted
        or replaced (never silent; a live run's manifest lags its files, never leads them); or
        listing fields none of its files hold."""
        claimed = sum(e.get("records") or 0 for _, e in self._entries if isinstance(e.get("records"), int))
        if claimed > self._n and all(m.get("status") == "closed" for m, _ in self._entries):
            return (f"handle {self.id!r}: the manifest lists {claimed} records, its files hold {self._n} "
                    f"(files missing or replaced; run `hookline verify`)")
        gone = sorted({nm for m, e in self._entries for nm in missing_fields(m, e, self._names)})
        if gone:
            return (f"handle {self.id!r}: the manifest lists fields {gone} that none of its files hold "
                    f"(files damaged or replaced; run `hookline verify`)")
        return None

    def _report(self, errors: list[StorageError | FormatError], missing: str | None = None) -> None:
        """List the damaged complete files (those discovery could not open and those that did not
        open here) in :attr:`problems` and say so in one warning: they are skipped, the rest of
        the handle (and of the run) stays readable; a handle whose every file is damaged reads as
        empty, never silently."""
        root = getattr(self.run.source, "root", None)
        self._problems = self._refused + [f"cannot open {str(Path(root) / rel if root is not None else rel)!r} of handle "
                          f"{self.id!r}: {why}" for rel, why in self._broken] + [str(e) for e in errors]
        if missing and not self._problems:  # (damaged files already explain the shortfall)
            self._problems.append(missing)
        if self._problems:
            n = len(self._problems)
            warnings.warn(f"hookline: skipping {n} unreadable file{'s' if n > 1 else ''} of handle {self.id!r} "
                          f"(listed in its .problems; run `hookline verify`): {'; '.join(self._problems)}",
                          stacklevel=4)

    @property
    def problems(self) -> list[str]:
        """The handle's damaged files, one line each (they are skipped; ``hookline verify``
        reports them and ``verify --repair`` moves them aside). Opens the handle's files."""
        self._load()
        return self._problems

    def _open_parts(self) -> tuple[list[Part], list[LazyPart], list[StorageError | FormatError]]:
        """Open every listed part: the opened parts with their :class:`LazyPart`, and the errors
        of those that did not open."""
        parts, lazy, errors = [], [], []
        for lp in self._lazy:
            try:
                parts.append(lp.open(self.id))
                lazy.append(lp)
            except (StorageError, FormatError) as e:
                errors.append(e)
        return parts, lazy, errors

    def _index(self, parts: list[Part]) -> None:
        """Record offsets and field names (in order of first appearance) of the opened parts."""
        self._parts = parts
        ends = list(accumulate(p.n for p in parts))
        self._base = np.array([0, *ends[:-1]], np.int64)[: len(parts)]
        self._n = ends[-1] if ends else 0
        names: list[str] = []
        for p in parts:
            for nm in p.field_names:
                if nm not in names:
                    names.append(nm)
        self._names = names
        self._loaded = True

    def _close(self) -> None:
        """Close the opened parts and forget what was loaded (the next read opens them again)."""
        for lp in self._lazy:
            if lp.part is not None:
                lp.part.close()
                lp.part = None
        self._loaded = False
        self._fields.clear()
        for attr in ("steps", "calls", "ranks"):  # (cached properties)
            self.__dict__.pop(attr, None)

    @property
    def file_bytes(self) -> int | None:
        """Bytes on disk of the handle's files (its final file and sealed segments; for an MLflow
        run, the sizes of those artifacts, without downloading them), or None when a size is not
        known."""
        size = getattr(self.run.source, "size", None)
        if size is None:
            return None
        total = 0
        for rel in [lp.rel for lp in self._listed] + [rel for rel, _ in self._broken]:
            n = size(rel)
            if n is None:
                return None
            total += n
        return total

    @property
    def fields(self) -> list[str]:
        """Field names (e.g. ``["outputs.0", "grad_in.0"]``)."""
        self._load()
        return list(self._names)

    def __len__(self) -> int:
        """Number of records."""
        self._load()
        return self._n

    @cached_property
    def steps(self) -> np.ndarray:
        """int64 step of every record."""
        self._load()
        return np.concatenate([p.steps for p in self._parts]) if self._parts else np.zeros(0, np.int64)

    @cached_property
    def calls(self) -> np.ndarray:
        """int64 call index (within its step) of every record."""
        self._load()
        return np.concatenate([p.calls for p in self._parts]) if self._parts else np.zeros(0, np.int64)

    @cached_property
    def ranks(self) -> np.ndarray:
        """int64 rank of every record (-1 when not distributed)."""
        self._load()
        return np.concatenate(
            [np.full(p.n, -1 if lp.rank is None else lp.rank, np.int64) for p, lp in zip(self._parts, self._lazy)]
        ) if self._parts else np.zeros(0, np.int64)

    def __getitem__(self, name: str) -> Field | LogicalField:
        f = self._fields.get(name)
        if f is None:
            self._load()
            if name not in self._names:
                raise UnknownNameError(self._not_sealed(name) or f"unknown field {name!r} of handle {self.id!r}; "
                                       f"available: {names_hint(self._names)}")
            # A DTensor field of several ranks reads as its logical tensors (shards.py).
            f = self._fields[name] = (len(self._entries) > 1 and logical_field(
                self, name, [(m.get("rank"), e.get("meta")) for m, e in self._entries])) or Field(self, name)
        return f

    def _not_sealed(self, name: str) -> str | None:
        """Why a handle with no record has no field ``name`` yet: its open run sealed nothing of it."""
        if self._n or self._problems:
            return None
        return not_sealed_yet(getattr(self.run.source, "root", None),
                              f"handle {self.id!r} of run {self.run.path!r} has no sealed record yet (so no field {name!r})",
                              open_manifest=any(m.get("status") == "open" for m, _ in self._entries))

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._names

    def frame(self, fields: str | Sequence[str] | None = None) -> Any:
        """:meth:`Field.frame` of ``fields`` (None: all) with a ``field`` column in front (a
        ``mode="stats"`` handle: one row per record of each summarised field, its statistics as
        columns ``norm``, ``mean``, ``std``, ``min``, ``max``, ``absmax``). Needs
        ``pip install "hookline[analysis]"`` (pandas)."""
        from .analysis.frames import handle_frame
        return handle_frame(self, fields)

    def to_xarray(self, fields: str | Sequence[str] | None = None, chunks: int | str = "auto") -> Any:
        """The fixed-shape fields with an entry in every record (None: all of them; the others are
        named in ``attrs["skipped"]``) as a lazy ``xarray.Dataset`` on dim ``record`` (as
        :meth:`Field.to_xarray`; a field's own axes are ``<field>.dim_<k>``). Needs
        ``pip install "hookline[analysis]"``."""
        from .analysis.lazy import handle_xarray
        return handle_xarray(self, fields, chunks)

    def __repr__(self) -> str:
        return f"Handle({self.id!r}, module_type={self.module_type!r}, category={self.category!r})"


class Field:
    """One field of a handle: lazy, indexable by record (only records where it is present).

    Attributes:
        name: field name.
        dtype_name: logical dtype (``"bfloat16"``...); same as :attr:`torch_dtype_name`.
    """

    def __init__(self, handle: Handle, name: str):
        self.handle = handle
        self.name = name
        segs: list[tuple[int, PartField]] = []
        for i, p in enumerate(handle._parts):
            if name in p.field_names:
                segs.append((i, p.field(name)))
        self._segs = segs
        names = {pf.dtype_name for _, pf in segs}
        if len(names) != 1:
            raise FormatError(f"field {name!r} of {handle.id!r} has inconsistent dtypes {sorted(names)}")
        self.dtype_name: str = names.pop()
        self._info = dtypes.info(self.dtype_name)
        shapes = {pf.shape for _, pf in segs}
        self._shape = shapes.pop() if len(shapes) == 1 else None
        # (plain ints for the one-record path: numpy scalars and searchsorted cost microseconds
        # per record, as much as HDF5's own read of a small record)
        self._bounds: list[int] = [0, *accumulate(pf.count for _, pf in segs)]
        self._cum = np.array(self._bounds, np.int64)
        self._n = self._bounds[-1]

    # --- metadata -------------------------------------------------------------------------------------
    @property
    def dtype(self) -> np.dtype:
        """numpy dtype of what reads return (bfloat16/float8 -> float32, complex32 -> complex64)."""
        return self._info.read

    @property
    def torch_dtype_name(self) -> str:
        """The exact torch dtype name (``torch.<name>``) of the recorded tensors."""
        return self.dtype_name

    @property
    def shape(self) -> tuple[int, ...] | None:
        """Per-record shape, or None when the shape varies between records (ragged)."""
        return self._shape

    @property
    def ragged(self) -> bool:
        """True when the per-record shape varies."""
        return self._shape is None

    def __len__(self) -> int:
        return self._n

    @cached_property
    def records(self) -> np.ndarray:
        """Handle record index (position in ``handle.steps``) of each of this field's entries."""
        h = self.handle
        parts = [h._base[i] + (pf.records - h._parts[i].record_start) for i, pf in self._segs]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    @cached_property
    def steps(self) -> np.ndarray:
        """Step of each entry of this field."""
        return self.handle.steps[self.records]

    @cached_property
    def calls(self) -> np.ndarray:
        """Call index of each entry of this field."""
        return self.handle.calls[self.records]

    @cached_property
    def _step_order(self) -> tuple[np.ndarray, np.ndarray]:
        """Entry indices sorted by step (stable), and the steps in that order."""
        order = np.argsort(self.steps, kind="stable")
        return order, self.steps[order]

    def step_indices(self, step: int) -> np.ndarray:
        """Entry indices recorded at ``step``, in record order (O(log n) after the first call).

        Raises:
            InvalidArgumentError: ``step`` is not an int.
        """
        if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)):
            raise InvalidArgumentError(f"step must be an int, got {type(step).__name__} {step!r:.60}")
        order, sorted_steps = self._step_order
        lo, hi = np.searchsorted(sorted_steps, step, "left"), np.searchsorted(sorted_steps, step, "right")
        return np.sort(order[lo:hi])

    def record_shape(self, i: int) -> tuple[int, ...]:
        """Shape of entry ``i`` (no data read)."""
        s, j = self._locate(i)
        return self._segs[s][1].record_shape(j)

    # --- reading --------------------------------------------------------------------------------------
    def _locate(self, i: int) -> tuple[int, int]:
        n = self._n
        ii = int(i)
        if ii < 0:
            ii += n
        if not 0 <= ii < n:
            raise RecordIndexError(
                f"record {i!r} out of range for field {self.name!r} of {self.handle.id!r}, which has {n} "
                f"records (valid: 0..{n - 1}, or negative from the end)")
        if len(self._bounds) == 2:  # (one part: the usual closed run)
            return 0, ii
        s = bisect.bisect_right(self._bounds, ii) - 1
        return s, ii - self._bounds[s]

    def _stored(self, i: int) -> np.ndarray:
        s, j = self._locate(i)
        return self._segs[s][1].read_stored(j)

    def __getitem__(self, index: int | slice) -> np.ndarray | list[np.ndarray]:
        """``field[i]`` one record; ``field[a:b]`` records stacked on a new axis 0 (list if ragged)."""
        if isinstance(index, (int, np.integer)):  # (first: the one-record read is the hot path)
            return dtypes.decode(self._stored(index), self.dtype_name)
        if isinstance(index, slice):
            return self._read_range(*index.indices(len(self)))
        raise InvalidArgumentError(f"field index must be an int or a slice, got {index!r}")

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(len(self)):
            yield self[i]

    def read(self) -> np.ndarray | list[np.ndarray]:
        """All records: stacked along a new axis 0, or a list of arrays when ragged."""
        return self[:]

    def _read_range(self, a: int, b: int, step: int = 1) -> np.ndarray | list[np.ndarray]:
        if step != 1 or self._shape is None:
            return self._gather(list(range(a, b, step)))
        if b <= a:
            return np.zeros((0, *self._shape), self.dtype)
        return dtypes.decode(self.read_stored(a, b), self.dtype_name)

    def read_stored(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray | list[np.ndarray]:
        """Entries ``[start, stop)`` as stored: raw bits for dtypes numpy lacks (bfloat16 as
        ``uint16``, see :mod:`~.dtypes`), one block read per file part, stacked on a new axis 0
        (a list of per-entry arrays when ragged). For readers that convert blocks themselves
        (exact torch tensors without a float32 round trip).

        Args:
            start, stop: the entries (clipped to the field, as a slice).
            out: a C-contiguous array of shape ``(stop - start, *shape)`` and the stored dtype
                to read into (fixed-shape fields), so a reader can reuse its buffers.

        Raises:
            InvalidArgumentError: ``out`` does not fit (or the field is ragged).
        """
        start, stop, _ = slice(start, stop).indices(self._n)
        stop = max(start, stop)
        if out is not None and (self._shape is None or out.shape != (stop - start, *self._shape)
                                or out.dtype != self._info.storage or not out.flags.c_contiguous):
            raise InvalidArgumentError(
                f"out must be a C-contiguous {self._info.storage} array of shape {(stop - start, *(self._shape or ()))} "
                f"for entries [{start}, {stop}) of {self.name!r}, got {out.dtype} {out.shape}"
                + (" (the field is ragged: read without out)" if self._shape is None else ""))
        if self._shape is None:
            return [self._stored(i) for i in range(start, stop)]
        blocks = []
        for s, (_, pf) in enumerate(self._segs):
            lo, hi = int(self._cum[s]), int(self._cum[s + 1])
            x, y = max(start, lo), min(stop, hi)
            if x < y:
                blocks.append(pf.read_block(x - lo, y - lo, None if out is None else out[x - start : y - start]))
        if out is not None:
            return out
        if not blocks:
            return np.zeros((0, *self._shape), self._info.storage)
        return blocks[0] if len(blocks) == 1 else np.concatenate(blocks)

    def _gather(self, idx: Sequence[int]) -> np.ndarray | list[np.ndarray]:
        recs = [self[int(i)] for i in idx]
        if self._shape is None:
            return recs
        if not recs:
            return np.zeros((0, *self._shape), self.dtype)
        return np.stack(recs)

    def at_step(self, step: int) -> np.ndarray | list[np.ndarray]:
        """The records of ``step`` (all calls, all ranks), stacked (a list if ragged).

        Raises:
            InvalidArgumentError: ``step`` is not an int.
            UnknownNameError: the handle recorded nothing at ``step`` (the message lists what it
                did record). A step the handle recorded without this field gives zero rows.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise InvalidArgumentError(f"step must be an int, got {step!r}")
        idx = self.step_indices(step)
        if idx.size == 0 and not np.any(self.handle.steps == step):
            # (a step the handle recorded without this field, e.g. a None gradient, gives 0 rows)
            steps = np.unique(self.handle.steps)
            shown = ", ".join(map(str, steps[:20])) + (" ..." if steps.size > 20 else "")
            raise UnknownNameError(
                f"field {self.name!r} of {self.handle.id!r} has no record at step {step!r}; "
                f"recorded steps: {shown or 'none'}")
        return self._gather(idx)

    def norms(self) -> np.ndarray:
        """float64 L2 norm of every entry (stored by the writer for float/complex fields; computed
        by reading the data for int/bool fields)."""
        out = []
        for s, (_, pf) in enumerate(self._segs):
            sn = pf.stored_norms
            if sn is None:
                lo = int(self._cum[s])
                sn = np.array([float(np.linalg.norm(np.asarray(self._stored(lo + j), np.float64).ravel()))
                               for j in range(pf.count)], dtype=np.float64)
            out.append(sn)
        return np.concatenate(out) if out else np.zeros(0, np.float64)

    def to_torch(self, index: int | slice | None = None) -> Any:
        """Entry ``index`` as a torch tensor of the exact recorded dtype (bfloat16 included;
        imports torch); a slice, or None for every entry: stacked along a new axis 0 (a list of
        tensors when ragged)."""
        if isinstance(index, (int, np.integer)):
            return dtypes.to_torch(self._stored(index), self.dtype_name)
        from .analysis.tensors import field_tensors
        return field_tensors(self, index)

    @property
    def pieces(self) -> list[PartField]:
        """The field's entries file by file, in entry order (each part's ``count``, file and
        chunks): what the analysis tools read."""
        return [pf for _, pf in self._segs]

    def frame(self) -> Any:
        """One row per entry: ``step``, ``call``, ``rank`` (-1 when not distributed), ``norm``
        (the stored L2 norm; NaN for int/bool fields), read from the record index only. Needs
        ``pip install "hookline[analysis]"`` (pandas)."""
        from .analysis.frames import field_frame
        return field_frame(self)

    def to_dask(self, chunks: int | str = "auto") -> Any:
        """A lazy ``dask.array.Array`` of shape ``(len(self), *shape)``, equal to :meth:`read`,
        chunked along records in whole storage chunks (``chunks``: about that many records, or
        ``"auto"``: dask's ``array.chunk-size``); computes on ``dask.distributed`` process
        workers that see the run directory. Needs ``pip install "hookline[analysis]"``.

        Raises:
            InvalidArgumentError: the field is ragged (the message says what reads it).
        """
        from .analysis.lazy import field_dask
        return field_dask(self, chunks)

    def to_xarray(self, chunks: int | str = "auto", dims: Sequence[str] | None = None) -> Any:
        """:meth:`to_dask` as an ``xarray.DataArray``: dims ``("record", *dims)`` (default
        ``dim_0``...), a (``step``, ``call``, ``rank``) index on ``record`` (``.sel(step=3)``),
        attrs ``handle``, ``module``, ``field``, ``dtype`` (the torch dtype name). Needs
        ``pip install "hookline[analysis]"``."""
        from .analysis.lazy import field_xarray
        return field_xarray(self, chunks, dims)

    def __repr__(self) -> str:
        return (f"Field({self.handle.id!r}/{self.name!r}, records={len(self)}, dtype={self.dtype_name}, "
                f"shape={self._shape})")


def _kind(path: str | Path) -> str | None:
    """``"dir"``, ``"file"`` or another word for what ``path`` names (after symlinks); None when
    nothing is there (one ``stat``)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"


def open_run(path_or_uri: str | os.PathLike[str], *, tracking_uri: str | None = None,
             cache_dir: str | os.PathLike[str] | None = None, max_open_files: int | None = None,
             verify_checksums: bool = False) -> Run:
    """Open a recorded run for reading.

    Args:
        path_or_uri: a run directory (or its ``manifest*.json``); an MLflow URI ``runs:/<id>`` or
            ``mlflow-artifacts:...``; or a bare 32-hex MLflow run id when ``tracking_uri`` is given
            and no such local path exists.
        tracking_uri: MLflow tracking URI for MLflow runs (default: MLflow's usual resolution).
        cache_dir: where MLflow downloads are cached.
        max_open_files: most files kept open at once; reading one more closes the least recently
            read (it reopens when read again: ~0.3 ms, measured). None: a quarter of the open-file
            limit (``ulimit -n``) minus 64, between 8 and 256.
        verify_checksums: every read checks the chunk hashes of the blocks it reads (once per
            block; a block is read whole: about a chunk, ~1 MiB). Damage raises
            :class:`FormatError` naming the file, field and entries. Files without hashes read
            unchecked.

    Returns:
        The :class:`Run` (lazy: files open on first access).

    Raises:
        StorageError: no such directory.
        FormatError: not a hookline run / unsupported version.

    Example:
        >>> run = open_run("runs/baseline")
        >>> x = run["outputs[blocks.0]"]["outputs.0"][3]     # one record, numpy
    """
    if not isinstance(path_or_uri, (str, bytes, os.PathLike)):
        raise HookTypeError(
            f"open_run() needs a run directory path or an MLflow URI such as 'runs:/<id>', got "
            f"{type(path_or_uri).__name__} {path_or_uri!r:.80}")
    s = os.fspath(path_or_uri)
    if isinstance(s, bytes):
        s = s.decode()
    remote = find_source(s, tracking_uri)  # runs:/... (registered by hookline.storage)
    if remote is not None:
        return Run(remote(s, tracking_uri=tracking_uri, cache_dir=cache_dir), s, max_open_files, verify_checksums)
    p = Path(s)
    kind = _kind(s)
    if kind == "file" and MANIFEST_RE.fullmatch(p.name):
        p = p.parent
        kind = _kind(p)
    if kind != "dir":
        raise StorageError(f"no run directory {s!r}: give the directory a RunWriter/Recorder wrote "
                           f"(or runs:/<mlflow run id>)")
    return Run(LocalSource(p), s, max_open_files, verify_checksums)  # (no manifest and no hookline file: FormatError)
