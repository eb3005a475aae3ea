"""What a handle part may hold: :func:`check_structure` walks a file's links and objects once at
open and refuses what could make a read leave the file or allocate without bound.

:func:`~._h5read.open_part` calls it before anything else reads the file, so the reader, verify,
repair's merges, export, compare and sync never follow a link, external storage or a virtual
dataset out of a file, never run a filter off the allow-list, and never allocate more than a
genuine file of the same size could need.
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from h5py import h5a, h5d, h5g, h5l, h5o, h5t

from .errors import FormatError
from .format import INDEX_GROUP

__all__ = ["Structure", "check_structure", "checked_structure", "records_end", "root_attrs", "damaged", "attr_str",
           "filter_names", "forget", "known", "remember", "same_structure", "HINT", "MAX_CHUNK_BYTES", "CHECK_WRITTEN_ENV"]

#: HDF5 compression filters a part may use (one per dataset), by filter id: name and the largest
#: factor by which it can shrink data (deflate 1032, lzf ~88, lz4 ~255, zstd ~32768, Blosc2 ~17500
#: (a 4 MiB all-zero chunk is 240 bytes) on all-zero chunks; with a margin). A dataset may declare
#: at most that many times the file's size.
_COMPRESSORS = {1: ("gzip", 1100), 32000: ("lzf", 100), 32004: ("lz4", 300), 32015: ("zstd", 40000),
                32026: ("blosc2", 40000)}
#: Filters that only reorder or checksum bytes (allowed with or without a compressor).
_TRANSFORMS = {2: "shuffle", 3: "fletcher32"}
#: Largest chunk a part may declare, in bytes (hookline writes data chunks of at most 4 MiB and
#: ragged shape-index chunks of at most 65536 x ndim x 8 bytes).
MAX_CHUNK_BYTES = 64 << 20
#: Where a part's error messages point the user.
HINT = "(the file is damaged or was not written by hookline; `hookline verify --repair` moves it aside)"
_HOW = {h5d.COMPACT: "compact", h5d.CONTIGUOUS: "contiguous", h5d.CHUNKED: "chunked"}


def damaged(where: str, what: str) -> FormatError:
    """The error for a damaged part: names the file and what is wrong, says what to do."""
    return FormatError(f"{where!r}: {what} {HINT}")


class Structure:
    """What :func:`check_structure` found (all checked): the shape, filters and attributes of every
    dataset, and the attributes of every group, by HDF5 path without the leading ``/`` (the
    root group is ``""``). Attributes are read here once, strings decoded. Shared by every
    open of the same file (:func:`checked_structure`): read-only."""

    __slots__ = ("shapes", "dtypes", "filters", "attrs", "memo")

    def __init__(self) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, np.dtype] = {}
        self.filters: dict[str, list[str]] = {}
        self.attrs: dict[str, dict[str, Any]] = {}
        #: What readers derived from it and checked (kept with the structure: a file whose
        #: structure is reused is not checked again), by the reader's name for it.
        self.memo: dict[str, Any] = {}

    def add(self, name: str, attrs: dict[str, Any], shape: tuple[int, ...] | None = None,
            dtype: np.dtype | None = None, filters: list[str] | None = None) -> None:
        """Note an object as :func:`check_structure` would find it: a dataset when ``shape`` is
        given, else a group (what a writer wrote, see :func:`remember`)."""
        if shape is not None:
            self.shapes[name] = tuple(shape)
            self.dtypes[name] = np.dtype(dtype)
            self.filters[name] = list(filters or [])
        self.attrs[name] = attrs


def check_structure(f: h5py.File | h5py.h5f.FileID, where: str) -> Structure:
    """Refuse a file holding anything a hookline part never holds that could make a read leave
    the file or allocate without bound. Walks every link and object once with HDF5's low-level
    calls and reads every attribute (no dataset data).

    Refused: soft, external and user-defined links (never followed); datasets with external raw
    storage and virtual datasets; datasets of other than plain numeric types (references,
    variable-length, compound...) and attributes of other than numbers or strings; filters
    other than one of deflate, lzf, lz4, zstd and Blosc2 plus shuffle and fletcher32; chunks over
    :data:`MAX_CHUNK_BYTES`; a dataset declaring more bytes than its compressor can expand the
    file's size to (an index dataset, which hookline stores uncompressed: more than the file's
    size); an attribute larger than the file.

    Returns:
        The file's :class:`Structure`.

    Raises:
        FormatError: what was refused, naming the file and the object.
    """
    fid = f.id if isinstance(f, h5py.File) else f
    size = int(fid.get_filesize())
    links: list[tuple[bytes, int]] = []
    fid.links.visit(lambda name, info: links.append((name, info.type)), info=True)
    st = Structure()
    st.attrs[""] = _read_attrs(fid, "/", size, where)
    for raw, kind in links:
        name = raw.decode("utf-8", "surrogateescape")
        if kind != h5l.TYPE_HARD:
            raise damaged(where, f"{name!r} is {_link_text(fid, raw, kind)}; hookline files hold only hard "
                                  f"links and it is not followed")
        oid = h5o.open(fid, raw)
        if isinstance(oid, h5d.DatasetID):
            st.shapes[name], st.filters[name] = _check_dataset(oid, name, size, where)
            st.dtypes[name] = oid.dtype
        elif not isinstance(oid, h5g.GroupID):
            raise damaged(where, f"{name!r} is a {type(oid).__name__}, not a group or dataset")
        st.attrs[name] = _read_attrs(oid, name, size, where)
    return st


#: Structures of the files this process checked or wrote (:func:`remember`), by the identity of
#: the file (device, inode, size, modification and change time; least recently used dropped
#: beyond the bound: ~4 KB each for a one-field part, ~16 MB in all).
_CHECKED: OrderedDict[tuple[int, ...], Structure] = OrderedDict()
_CHECKED_MAX = 4096
_CHECKED_LOCK = threading.Lock()


def _identity(st: os.stat_result) -> tuple[int, ...]:
    # (ctime cannot be set from user space: a file written or touched since has another one)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _cached(ident: tuple[int, ...] | None) -> Structure | None:
    if ident is None:
        return None
    with _CHECKED_LOCK:
        st = _CHECKED.get(ident)
        if st is not None:
            _CHECKED.move_to_end(ident)
        return st


def checked_structure(f: h5py.File | h5py.h5f.FileID, where: str) -> Structure:
    """:func:`check_structure` of ``f``, once per file per process: a file whose identity
    (device, inode, size, modification and change time, taken from the open descriptor) is
    unchanged since it passed the walk is the same file, so the walk's result is reused (the walk
    reads every attribute through HDF5: ~1-3 ms, most of opening a part). Only files that passed
    are remembered.

    Raises:
        FormatError: what :func:`check_structure` refused.
    """
    try:
        fid = f.id if isinstance(f, h5py.File) else f
        ident: tuple[int, ...] | None = _identity(os.fstat(fid.get_vfd_handle()))
    except Exception:  # (a driver without a descriptor: no reuse)
        ident = None
    st = _cached(ident)
    if st is None:
        st = check_structure(f, where)
        if ident is not None:
            _store(ident, st)
    return st


def _store(ident: tuple[int, ...], st: Structure) -> None:
    """Keep ``st`` under ``ident`` as the most recently used (dropping beyond the bound)."""
    with _CHECKED_LOCK:
        _CHECKED[ident] = st
        _CHECKED.move_to_end(ident)
        while len(_CHECKED) > _CHECKED_MAX:
            _CHECKED.popitem(last=False)


#: Set (to anything but "" or "0") to walk every file a writer :func:`remember`\ s as well and
#: compare: the test suite sets it, so every file written in a test checks the writer's account.
CHECK_WRITTEN_ENV = "HOOKLINE_CHECK_WRITTEN"


def remember(path: Path, st: Structure | None) -> None:
    """Take ``st`` as the checked structure of the file at ``path``, which this process has just
    written and closed and will not change (after its last rename: a rename changes the file's
    identity). The writer knows what it wrote, so its own parts are not walked when it merges
    them or a reader opens them in the same process (the walk was half of merging a small
    part). Nothing is remembered for ``st`` None (a file the writer could not describe).

    Raises:
        AssertionError: with :data:`CHECK_WRITTEN_ENV` set, the walk finds another structure.
    """
    if st is None:
        return
    ident = _identity(os.stat(path))
    if os.environ.get(CHECK_WRITTEN_ENV, "") not in ("", "0"):
        with h5py.File(path, "r") as f:
            walked = check_structure(f, str(path))
        diff = same_structure(walked, st)
        assert diff is None, f"{str(path)!r}: the writer's account of the file differs from its walk: {diff}"
    _store(ident, st)


def known(path: Path) -> Structure | None:
    """The structure remembered or walked for the file at ``path`` as it is now, or None."""
    try:
        return _cached(_identity(os.stat(path)))
    except OSError:
        return None


def forget(path: Path) -> Structure | None:
    """Drop what is remembered of the file at ``path`` as it is now (call it before removing or
    renaming a file: the entries of files that are gone would push out those of files still to
    be merged); returns it."""
    try:
        ident = _identity(os.stat(path))
    except OSError:
        return None
    with _CHECKED_LOCK:
        return _CHECKED.pop(ident, None)


def same_structure(a: Structure, b: Structure) -> str | None:
    """None when ``a`` and ``b`` describe the same objects, types, filters and attribute values
    (types included), else what differs first."""
    for what in ("shapes", "dtypes", "filters"):
        x, y = getattr(a, what), getattr(b, what)
        if x != y:
            keys = sorted(set(x) | set(y))
            k = next(k for k in keys if x.get(k) != y.get(k))
            return f"{what}[{k!r}]: {x.get(k)!r} != {y.get(k)!r}"
    if set(a.attrs) != set(b.attrs):
        return f"objects {sorted(a.attrs)} != {sorted(b.attrs)}"
    for obj, xa in a.attrs.items():
        ya = b.attrs[obj]
        if set(xa) != set(ya):
            return f"attributes of {obj!r}: {sorted(xa)} != {sorted(ya)}"
        for k, x in xa.items():
            y = ya[k]
            if type(x) is not type(y) or (isinstance(x, np.ndarray) and (x.dtype != y.dtype or x.shape != y.shape)):
                return f"attribute {k!r} of {obj!r}: {type(x).__name__} {x!r} != {type(y).__name__} {y!r}"
            if not np.array_equal(np.asarray(x), np.asarray(y)):
                return f"attribute {k!r} of {obj!r}: {x!r} != {y!r}"
    return None


def records_end(path: Path) -> int:
    """``record_start + records`` of a complete file (its root attributes, checked). A file not
    seen before is walked whole (:func:`checked_structure`: the open that follows its discovery
    then reuses the walk); one the walk refuses falls back to its root attributes, so the caller
    decides about the damage as before.

    Raises:
        OSError: HDF5 cannot open it. FormatError: bad root attributes.
    """
    st = _cached(_identity(os.stat(path)))
    if st is None:
        with h5py.File(path, "r", rdcc_nbytes=0) as f:
            try:
                st = checked_structure(f, str(path))
            except Exception:
                st = None
            a = st.attrs[""] if st is not None else root_attrs(f, str(path))
    else:
        a = st.attrs[""]
    return int(a["record_start"]) + int(a["records"])


def root_attrs(f: h5py.File, where: str) -> dict[str, Any]:
    """The root attributes of ``f``, checked as :func:`check_structure` checks them (numbers or
    strings, none larger than the file), strings decoded: for a glance at a file (its handle and
    record range) without the whole walk.

    Raises:
        FormatError: an attribute of another type or larger than the file.
    """
    return _read_attrs(f.id, "/", int(f.id.get_filesize()), where)


def _link_text(fid: h5py.h5f.FileID, raw: bytes, kind: int) -> str:
    """What a link that is not a hard link points to, for the message (never resolved)."""
    what = {h5l.TYPE_SOFT: "a soft link", h5l.TYPE_EXTERNAL: "an external link"}.get(kind, "a user-defined link")
    try:
        val = fid.links.get_val(raw)
    except Exception:  # (the message must not fail on what it describes)
        return what
    if isinstance(val, tuple):
        val = b":".join(val)
    return f"{what} to {val.decode('utf-8', 'replace') if isinstance(val, bytes) else val!r}"


def _plain_numeric(dt: np.dtype) -> bool:
    return dt.kind in "biufc" and dt.fields is None and dt.subdtype is None


def _type_name(dt: np.dtype) -> str:
    if h5py.check_dtype(ref=dt) is not None:
        return "object/region references"
    if h5py.check_dtype(vlen=dt) is not None:
        return "variable-length data"
    return f"values of HDF5 type {dt}"


def _read_attrs(oid: Any, name: str, size: int, where: str) -> dict[str, Any]:
    """Every attribute of object ``oid`` (numbers or strings, each smaller than the file), read."""
    out: dict[str, Any] = {}
    for i in range(h5a.get_num_attrs(oid)):
        aid = h5a.open(oid, index=i)
        key = aid.name.decode("utf-8", "surrogateescape")
        dt = aid.dtype
        vlen = dt.kind == "O" and h5py.check_string_dtype(dt) is not None
        if not (_plain_numeric(dt) or dt.kind == "S" or vlen):
            raise damaged(where, f"attribute {key!r} of {name!r} holds {_type_name(dt)}")
        shape = aid.shape
        if shape is None:  # (an empty attribute: HDF5's null dataspace)
            out[key] = np.zeros(0, dt if not vlen else object)
            continue
        if math.prod(shape) * dt.itemsize > size:
            raise damaged(where, f"attribute {key!r} of {name!r} declares shape {shape}, larger than the "
                                  f"file ({size} bytes)")
        arr = np.zeros(shape, dtype=dt)
        if arr.size:
            aid.read(arr, mtype=h5t.py_create(dt))
        if vlen or dt.kind == "S":
            arr = np.array([attr_str(b) for b in arr.flat], dtype=object).reshape(arr.shape)
        out[key] = arr[()] if arr.ndim == 0 else arr
    return out


def _check_dataset(oid: h5d.DatasetID, name: str, size: int, where: str) -> tuple[tuple[int, ...], list[str]]:
    """Layout, storage, type, filters and declared size of one dataset (see :func:`check_structure`);
    returns its shape and filter names."""
    dcpl = oid.get_create_plist()
    layout = dcpl.get_layout()
    if layout not in _HOW:
        raise damaged(where, f"dataset {name!r} is a virtual dataset (its data would come from other "
                              f"files); it is not read")
    if dcpl.get_external_count():
        ext = dcpl.get_external(0)[0]
        ext = ext.decode("utf-8", "replace") if isinstance(ext, bytes) else ext
        raise damaged(where, f"dataset {name!r} stores its data outside the file (HDF5 external storage "
                              f"in {ext!r}); it is not read")
    dt = oid.dtype
    if not _plain_numeric(dt):
        raise damaged(where, f"dataset {name!r} holds {_type_name(dt)}; hookline stores numbers only")
    codes = [dcpl.get_filter(i)[0] for i in range(dcpl.get_nfilters())]
    unknown = [c for c in codes if c not in _COMPRESSORS and c not in _TRANSFORMS]
    comps = [c for c in codes if c in _COMPRESSORS]
    if unknown or len(comps) > 1:
        allowed = ", ".join(n for n, _ in _COMPRESSORS.values())
        raise damaged(where, f"dataset {name!r} uses HDF5 filters {codes}; a part may use one of {allowed} "
                              f"(plus shuffle, fletcher32)")
    index = name in ("step", "call") or name.startswith(INDEX_GROUP + "/")
    factor = 1 if index or not comps else _COMPRESSORS[comps[0]][1]
    shape = oid.shape
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes > size * factor:
        raise damaged(where, f"dataset {name!r} declares shape {shape} ({nbytes} bytes), more than a file "
                              f"of {size} bytes can hold")
    if layout == h5d.CHUNKED and math.prod(dcpl.get_chunk()) * dt.itemsize > MAX_CHUNK_BYTES:
        raise damaged(where, f"dataset {name!r} declares chunks {dcpl.get_chunk()} over "
                              f"{MAX_CHUNK_BYTES >> 20} MiB")
    return shape, _names(codes)


def _names(codes: list[int]) -> list[str]:
    """The names of allowed filter ids, in order."""
    return [_COMPRESSORS[c][0] if c in _COMPRESSORS else _TRANSFORMS[c] for c in codes]


def filter_names(dcpl: h5py.h5p.PropDCID) -> list[str]:
    """The names :func:`check_structure` gives the filters of a dataset creation list (a writer
    noting what it wrote: only filters it may use)."""
    return _names([dcpl.get_filter(i)[0] for i in range(dcpl.get_nfilters())])


def attr_str(a: Any) -> str:
    """An attribute value as str (bytes decoded as UTF-8, undecodable bytes kept as escapes)."""
    if isinstance(a, bytes):
        return a.decode("utf-8", "surrogateescape")
    return str(a)
