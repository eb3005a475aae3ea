"""The buffered background writer: :class:`RunWriter` (design in docs/storage.md).

The training thread calls :meth:`RunWriter.write`, which only validates, accounts the bytes
against ``max_buffer_mb`` and appends to an in-memory queue (microseconds, no HDF5 call). One
background thread stages records per field and writes whole chunks; h5py releases the GIL inside
HDF5 calls, so the training thread keeps running. Records go into *segment* files that are closed
and renamed (``.h5seg.partial`` -> ``.h5seg``) at every :meth:`flush`, so a SIGKILL never leaves
a flushed record in a file that may not open. A second thread compacts sealed segments; a clean
:meth:`close` merges them into one ``<key>.h5`` per handle.
"""

from __future__ import annotations

import atexit
import errno as _errno
import fnmatch
import json
import math
import numbers
import operator
import os
import re
import threading
import time
import uuid
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Union

import numpy as np

from . import dtypes
from ._h5file import (
    FieldSpec,
    HandleFileWriter,
    Writeback,
    compression_kwargs,
    check_max_open_files,
    merge_files,
)
from ._segments import discover_files
from .errors import (
    HookTypeError,
    InvalidArgumentError,
    StorageError,
    UnknownNameError,
    WriterClosedError,
)
from .format import (
    MANIFEST_RE,
    FORMAT_VERSION,
    MAX_STEP,
    RUN_FORMAT,
    atomic_write_json,
    check_field_name,
    final_name,
    fsync_dir,
    fsync_file,
    hookline_version,
    manifest_name,
    merge_output_name,
    now_iso,
    partial_segment_name,
    rank_suffix,
    read_manifest,
    run_identity,
    segment_name,
)
from .keys import handle_key

__all__ = ["RunWriter", "WriterStats", "HandleStats", "weak_closer"]

FieldValue = Union[np.ndarray, "tuple[np.ndarray, str]"]

_POLICIES = ("block", "drop")
#: Largest block assembled in memory for one write (bounds the scratch buffer).
_PIECE_BYTES = 8 << 20
#: Longest time a record waits in the queue before the writer thread takes it (see write()).
WAKE_LATENCY_S = 0.2
#: Merge this many similar-sized trailing segments into one (compaction fan-in).
COMPACT_FANIN = 8
#: No compaction while a handle has fewer sealed segments (each merge copies data; a few dozen
#: files are cheap, and close() merges everything once anyway).
COMPACT_MIN_SEGMENTS = 32


@dataclass
class HandleStats:
    """Counters of one handle.

    Attributes:
        records: records accepted by :meth:`RunWriter.write` (queued or on disk).
        bytes: field bytes of those records.
        dropped: records dropped by policy ``"drop"``.
        flushed: records durably on disk (sealed by a flush / auto-flush / close), including
            ``start``.
        start: records a continued run held before this writer opened it (0 for a new run).
    """

    records: int = 0
    bytes: int = 0
    dropped: int = 0
    flushed: int = 0
    start: int = 0


@dataclass
class WriterStats:
    """What a :class:`RunWriter` did; returned by :meth:`RunWriter.close` and :meth:`RunWriter.stats`.

    Attributes:
        handles: per handle id counters.
        peak_buffer_bytes: largest amount of accepted-but-not-written data held in memory.
        max_buffer_bytes: the budget (``max_buffer_mb``).
        blocked_seconds: total time ``write()`` waited for buffer space (policy ``"block"``).
        rotated_segments: segments sealed early to stay within ``max_open_files``.
        error: the background error message, if the writer failed.
    """

    handles: dict[str, HandleStats] = field(default_factory=dict)
    peak_buffer_bytes: int = 0
    max_buffer_bytes: int = 0
    blocked_seconds: float = 0.0
    rotated_segments: int = 0
    error: str | None = None

    @property
    def records(self) -> int:
        """Total accepted records."""
        return sum(h.records for h in self.handles.values())

    @property
    def bytes(self) -> int:
        """Total accepted field bytes."""
        return sum(h.bytes for h in self.handles.values())

    @property
    def dropped(self) -> int:
        """Total dropped records."""
        return sum(h.dropped for h in self.handles.values())

    def __str__(self) -> str:
        return (f"WriterStats(handles={len(self.handles)}, records={self.records}, bytes={self.bytes}, "
                f"dropped={self.dropped}, peak_buffer_bytes={self.peak_buffer_bytes}"
                + (f", error={self.error!r}" if self.error else "") + ")")


@dataclass
class _Seg:
    start: int
    end: int
    path: Path
    nbytes: int


class _StagedField:
    """A field's records in the open segment that are not yet written to HDF5."""

    __slots__ = ("spec", "out", "arrays", "staged_items", "staged_bytes", "written_items",
                 "records", "norms", "offsets", "shapes", "item_bytes", "chunk_items")

    def __init__(self, spec: FieldSpec):
        self.spec = spec
        self.out = None
        self.arrays: deque[np.ndarray] = deque()  # runs: (m, *shape) fixed, flat 1-D ragged
        self.staged_items = 0  # records (fixed) or elements (ragged) staged
        self.staged_bytes = 0
        self.written_items = 0
        self.records: list[int] = []
        self.norms: list[float] = []
        self.offsets: list[int] = []
        self.shapes: list[tuple[int, ...]] = []
        st = spec.info.storage
        self.item_bytes = st.itemsize if spec.ragged else st.itemsize * math.prod(spec.shape)
        self.chunk_items = 0  # known once the dataset exists


class _OpenSeg:
    """The segment file currently written for one handle."""

    def __init__(self, start: int, partial: Path, writer: HandleFileWriter):
        self.start = start
        self.partial = partial
        self.writer = writer
        self.steps: list[int] = []
        self.calls: list[int] = []
        self.fields: dict[str, _StagedField] = {}


class _Handle:
    def __init__(self, handle_id: str, key: str, suffix: str, info: dict[str, Any]):
        self.id = handle_id
        self.key = key
        self.suffix = suffix
        self.info = info
        # caller-thread validation caches
        self.known: set[str] = set()
        self.field_dtype: dict[str, str] = {}
        self.field_ndim: dict[str, int] = {}
        self.stats = HandleStats()
        # writer-thread state
        self.started = False
        self.next_record = 0
        self.base: list[Path] = []  # complete files found at start (resumed run)
        self.sealed: list[_Seg] = []
        self.seg: _OpenSeg | None = None
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.ragged: set[str] = set()
        self.steps_min: int | None = None
        self.steps_max: int | None = None
        self.written_bytes = 0
        self.final_done = False


class _Event:
    def __init__(self) -> None:
        self.ev = threading.Event()
        self.error: BaseException | None = None


_ERRNO_RE = re.compile(r"errno\s*=\s*(\d+)")


def _short(e: BaseException, limit: int = 240) -> str:
    """One line of an exception message (HDF5's are multi-line and long)."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


#: What to do about a background failure, by errno (the message quotes the cause either way).
_FIXES = {
    _errno.ENOSPC: "free disk space",
    _errno.EDQUOT: "free space within your disk quota",
    _errno.EMFILE: ("raise the open-file limit (ulimit -n), or pass a smaller max_open_files to "
                    "RunWriter (the writer keeps one file per handle written since the last flush "
                    "open, up to max_open_files)"),
    _errno.ENFILE: "close other files (the system's open-file table is full)",
    _errno.EIO: "check the device (an I/O error)",
    _errno.EROFS: "record to a writable file system",
    _errno.EACCES: "make the run directory writable",
}


def _check_steps(handle_id: str, steps: list[int], calls: list[int]) -> None:
    """Steps and calls are stored as int64: each must be in ``[0, MAX_STEP]`` (non-empty lists)."""
    if min(steps) < 0 or min(calls) < 0 or max(steps) > MAX_STEP or max(calls) > MAX_STEP:
        got = (f"step={steps[0]!r}, call={calls[0]!r}" if len(steps) == 1
               else f"steps {steps[:8]} calls {calls[:8]}")
        raise InvalidArgumentError(
            f"step and call numbers of {handle_id!r} must be non-negative ints up to 2**63 - 1 (stored as "
            f"int64), got {got}")


def _errno_of(e: BaseException) -> int | None:
    n = getattr(e, "errno", None)
    if isinstance(n, int):
        return n
    m = _ERRNO_RE.search(str(e))
    return int(m[1]) if m else None


class RunWriter:
    """Buffered background writer of one run directory (one rank).

    Args:
        run_dir: the run directory (created if missing). An existing run written by hookline is
            continued: new records of a handle are appended after the ones on disk.
        max_buffer_mb: memory budget for everything accepted by :meth:`write` but not yet written.
            A single record larger than the budget is accepted when nothing else is buffered.
        policy: ``"block"`` (``write`` waits for space) or ``"drop"`` (``write`` drops the record,
            returns False; counted per handle in the stats and the manifest).
        compression: ``None`` (default; measured no win for typical float data, see docs/storage.md),
            ``"gzip"``/``"gzip-<level>"``, ``"lzf"``, ``"zstd"``/``"zstd-<level>"``, ``"lz4"``, or
            a mapping from field-name glob pattern to one of those (first match wins).
        rank: this process's rank (``None`` when not distributed).
        world_size: number of ranks; with ``world_size > 1`` file names carry ``.rank<r>``.
        meta: JSON-serialisable run metadata (stored in the manifest and every file).
        autoflush_s: seal open segments (like :meth:`flush`, without waiting) when this many
            seconds passed since the last flush, bounding what a crash can lose; None disables.
        merge_on_close: merge each handle's segments into one ``<key>.h5`` at :meth:`close`.
            With False, segments stay (readable by ``open_run``; ``verify(repair=True)`` merges).
        fsync: fsync files and directories at flush/close (power-loss durability).
        writeback_mb: every this many MB written (over all open files), ask the kernel to start
            writing them to disk (asynchronously) and to drop their pages already on disk. Keeps the
            disk busy while the run goes on, so ``flush()``/``close()`` find little left to
            sync and a long run does not fill the page cache; 0 or None leaves writeback to
            the kernel. See docs/storage.md.
        max_open_files: most segment files open at once (one per handle written since the last
            flush). When more handles write, the least recently written handle's segment is
            sealed (closed, published as ``.h5seg``, fsynced at the next flush) and its next
            records start a new one. None (default): half the process's open-file limit
            (``ulimit -n``) minus 64 for everything else, between 8 and 1024.

    Example:
        >>> w = RunWriter("runs/a", max_buffer_mb=256)
        >>> w.add_handle("outputs[fc]", module_name="fc", module_type="torch.nn.Linear",
        ...              category="forward_hook", hook_fn_name="outputs")
        >>> w.write("outputs[fc]", 0, 0, {"outputs.0": np.ones((4, 8), np.float32)})
        True
        >>> stats = w.close()
    """

    #: Test hook: seconds slept per MiB written by the background thread (simulates a slow disk).
    test_delay_s_per_mb: float = 0.0

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        max_buffer_mb: float = 512,
        policy: str = "block",
        compression: str | Mapping[str, str | None] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        meta: Mapping[str, Any] | None = None,
        autoflush_s: float | None = 300.0,
        merge_on_close: bool = True,
        fsync: bool = True,
        writeback_mb: float | None = 32,
        max_open_files: int | None = None,
    ) -> None:
        if policy not in _POLICIES:
            raise InvalidArgumentError(f"policy must be 'block' or 'drop', got {policy!r}")
        if isinstance(max_buffer_mb, bool) or not isinstance(max_buffer_mb, numbers.Real):
            raise HookTypeError(f"max_buffer_mb must be a number of MB, got {type(max_buffer_mb).__name__} "
                                f"{max_buffer_mb!r:.60}")
        if not 0 < max_buffer_mb < float("inf"):
            raise InvalidArgumentError(f"max_buffer_mb must be a positive number, got {max_buffer_mb!r}")
        if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
            raise InvalidArgumentError(f"world_size must be a positive int or None, got {world_size!r}")
        if rank is not None and (not isinstance(rank, int) or rank < 0 or (world_size and rank >= world_size)):
            raise InvalidArgumentError(f"rank must be an int in [0, world_size), got {rank!r}")
        if writeback_mb is not None and (
            isinstance(writeback_mb, bool) or not isinstance(writeback_mb, (int, float)) or writeback_mb < 0
        ):
            raise InvalidArgumentError(
                f"writeback_mb must be a number >= 0 or None (0/None: leave writeback to the kernel), got {writeback_mb!r}"
            )
        # Half of the open-file limit (torch, sockets, readers and merges need files too).
        self.max_open_files = check_max_open_files(max_open_files, 2, 1024)
        self._compression = self._check_compression(compression)
        self._writeback_bytes = int((writeback_mb or 0) * (1 << 20))
        self._writeback = Writeback(self._writeback_bytes)  # shared by the open segments (writer thread)
        self.meta = json_meta(meta, "run meta")  # before anything is created
        self.run_dir = Path(run_dir)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create run directory {str(self.run_dir)!r}: {e}") from e
        self.rank, self.world_size = rank, world_size
        self.policy = policy
        self.max_buffer_bytes = int(max_buffer_mb * (1 << 20))
        self.autoflush_s = autoflush_s
        self.merge_on_close = merge_on_close
        self.fsync = fsync
        self._suffix = rank_suffix(rank, world_size)
        self._lock_fd = _lock_run(self.run_dir, self._suffix)
        self._manifest_path = self.run_dir / manifest_name(rank, world_size)
        self._created = now_iso()
        self._uuid = uuid.uuid4().hex  # identifies the run directory (e.g. to an MLflow run)
        self._old_handles: dict[str, Any] = {}
        if self._manifest_path.exists():
            try:
                old = read_manifest(self._manifest_path)
                self._created = old.get("created", self._created)
                self._uuid = run_identity(old) or self._uuid
                self._old_handles = dict(old.get("handles", {}))
            except Exception:
                pass  # verify() reports broken manifests; we rewrite it
        else:
            # A run directory continued at another world size (manifest.json -> manifest.rank<r>.json):
            # still the same run, for the MLflow run it is synced to.
            for other in sorted(p for p in self.run_dir.glob("*.json") if MANIFEST_RE.fullmatch(p.name)):
                try:
                    self._uuid = run_identity(read_manifest(other)) or self._uuid
                    break
                except Exception:
                    continue
        self._handles: dict[str, _Handle] = {}
        self._order: list[str] = []
        self._cond = threading.Condition()
        self._queue: deque[tuple] = deque()
        self._pending = 0
        # Records are picked up in batches: when this many bytes are queued, when a record
        # waited WAKE_LATENCY_S, or at once for control items and blocked writers.
        self._wake_bytes = max(64 << 10, min(self.max_buffer_bytes // 8, 16 << 20))
        self._queued_bytes = 0
        self._wake_sent = False
        self._urgent = 0
        self._queue_since: float | None = None
        self._stats = WriterStats(max_buffer_bytes=self.max_buffer_bytes)
        self._waiting = 0
        self._error: StorageError | None = None
        self._error_raised_by_close = False
        self._closed = False
        self._closing = False
        self._close_stats: WriterStats | None = None
        self._current_path: Path | None = None
        self._scratch = np.empty(0, np.uint8)
        # Handles with an open segment, least recently written first (writer thread only), and
        # segments sealed to stay under max_open_files, not fsynced yet (done at the next flush).
        self._open_lru: OrderedDict[str, _Handle] = OrderedDict()
        self._unsynced: list[Path] = []
        self._comp_cache: dict[str, str | None] = {}
        self._last_flush = time.monotonic()
        # compaction thread
        self._seg_lock = threading.Lock()
        self._compact_cond = threading.Condition()
        self._compact_wanted = False
        self._compact_stop = False
        self._compact_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"hookline-writer[{self.run_dir.name}]", daemon=True)
        self._thread.start()
        self._compactor = threading.Thread(target=self._compact_loop, name="hookline-compactor", daemon=True)
        self._compactor.start()
        # Close at interpreter exit (atexit runs while daemon threads still run), weakly.
        self._atexit = weak_closer(self)  # errors: reported through the manifest
        atexit.register(self._atexit)

    # --- configuration ----------------------------------------------------------------------------
    @staticmethod
    def _check_compression(c: Any) -> Any:
        specs = c.values() if isinstance(c, Mapping) else [c]
        for s in specs:
            if s is not None and not isinstance(s, str):
                raise HookTypeError(
                    f"compression must be None, a name such as 'gzip' or 'zstd-3', or a mapping of field "
                    f"patterns to names, got {type(s).__name__} {s!r:.60}")
            compression_kwargs(s)  # raises for unknown names / missing hdf5plugin
        return dict(c) if isinstance(c, Mapping) else c

    def _compression_for(self, name: str) -> str | None:
        try:
            return self._comp_cache[name]
        except KeyError:
            pass
        c = self._compression
        if isinstance(c, dict):
            spec = next((v for pat, v in c.items() if fnmatch.fnmatchcase(name, pat)), None)
        else:
            spec = c
        self._comp_cache[name] = spec
        return spec

    def add_handle(
        self,
        handle_id: str,
        *,
        module_name: str = "",
        module_type: str = "",
        category: str = "",
        hook_fn_name: str = "",
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        """Declare a handle (idempotent for the same id: later calls are ignored).

        Args:
            handle_id: the hook handle id, e.g. ``"outputs[blocks.0]"``.
            module_name: qualified module name.
            module_type: module class, e.g. ``"torch.nn.modules.linear.Linear"``.
            category: ``"forward_hook"``, ``"forward_pre_hook"`` or ``"backward_hook"``.
            hook_fn_name: the hook function's name.
            meta: JSON-serialisable per-handle metadata.
        """
        self._check_open()
        key = handle_key(handle_id)
        new_meta = json_meta(meta, f"meta of handle {handle_id!r}")
        with self._cond:
            old = self._handles.get(handle_id)
            if old is None and handle_id in self._old_handles:  # a continued run's handle
                old_meta = self._old_handles[handle_id].get("meta")
            else:
                old_meta = old.info["meta"] if old is not None else None
            if isinstance(old_meta, dict):
                changed = {k: (old_meta[k], v) for k, v in new_meta.items() if k in old_meta and _differs(old_meta[k], v)}
                if changed:
                    raise InvalidArgumentError(
                        f"handle {handle_id!r} already records with {', '.join(f'{k}={a!r}' for k, (a, _) in changed.items())}"
                        f" in {str(self.run_dir)!r}; records with {', '.join(f'{k}={b!r}' for k, (_, b) in changed.items())}"
                        f" would be mixed into it: give the hook another name")
            if old is not None:
                return
            info = {"module_name": str(module_name), "module_type": str(module_type),
                    "category": str(category), "hook_fn_name": str(hook_fn_name), "meta": new_meta}
            h = _Handle(handle_id, key, self._suffix, info)
            # A continued run: fields keep the dtype and ndim they were recorded with (checked
            # in write(), so a mismatch is a clear error now, not a failed merge at close).
            for name, f in self._old_handles.get(handle_id, {}).get("fields", {}).items():
                if isinstance(f, dict) and isinstance(f.get("dtype"), str):
                    h.field_dtype[name] = f["dtype"]
                    ndim = f.get("ndim", len(f["shape"]) if isinstance(f.get("shape"), list) else None)
                    if isinstance(ndim, int):
                        h.field_ndim[name] = ndim
            self._handles[handle_id] = h
            self._order.append(handle_id)
            self._stats.handles[handle_id] = h.stats
            self._queue.append(("handle", h))
            self._urgent += 1
            self._cond.notify_all()

    def update_handle_meta(self, handle_id: str, meta: Mapping[str, Any]) -> None:
        """Merge keys into a declared handle's metadata (e.g. fields discovered while recording).

        The manifest carries the merged metadata from the next flush/close on, and so do the
        attributes of files the writer creates afterwards; the manifest is authoritative.

        Raises:
            UnknownNameError: the handle was not declared with :meth:`add_handle`.
            HookTypeError: ``meta`` is not JSON-serialisable.
        """
        self._check_open()
        with self._cond:
            h = self._handles.get(handle_id)
            if h is None:
                raise UnknownNameError(
                    f"unknown handle {handle_id!r}: call add_handle() first (known: {sorted(self._handles)[:20]})")
            merged = {**h.info["meta"], **dict(meta)}
            try:
                json.dumps(merged)
            except (TypeError, ValueError) as e:
                raise HookTypeError(f"meta of handle {handle_id!r} is not JSON-serialisable: {e}") from None
            h.info["meta"] = merged

    # --- hot path -----------------------------------------------------------------------------------
    def write(self, handle_id: str, step: int, call: int, fields: Mapping[str, FieldValue]) -> bool:
        """Queue one record; returns in microseconds, never touches HDF5 on the calling thread.

        Args:
            handle_id: a handle declared with :meth:`add_handle`.
            step: training step (int).
            call: call index of the module within the step (int).
            fields: field name -> numpy array, or ``(raw_bits, dtype_name)`` for bfloat16 /
                float8 / complex32. The writer takes ownership: do not modify the arrays later.
                Missing fields (e.g. a None gradient) are simply absent.

        Returns:
            True if queued; False if policy ``"drop"`` dropped it (counted).

        Raises:
            WriterClosedError: after :meth:`close`.
            StorageError: the background thread failed earlier (full disk, I/O error).
            UnknownNameError, InvalidArgumentError, HookTypeError: bad arguments.
        """
        h = self._open_handle(handle_id)
        steps, calls = [int(operator.index(step))], [int(operator.index(call))]
        _check_steps(handle_id, steps, calls)
        return self._put(h, steps, calls, fields, None)

    def write_block(self, handle_id: str, steps: Any, calls: Any, fields: Mapping[str, FieldValue]) -> bool:
        """Queue ``k`` records of one handle at once (one queue entry, one validation).

        The records' arrays are stacked along a new first axis: field ``f`` of record ``j`` is
        ``fields[f][j]``, so every record of a block has the same fields, shapes and dtypes. A
        block of whole chunks (see docs/format.md) is written without any copy. Records are
        numbered in block order, exactly as ``k`` calls of :meth:`write` would number them.

        Args:
            handle_id: a handle declared with :meth:`add_handle`.
            steps: ``k`` non-negative ints (a sequence or 1-D integer array).
            calls: ``k`` non-negative ints.
            fields: field name -> array of shape ``(k, *record_shape)``, or
                ``(raw_bits, dtype_name)`` with bits of that shape. The writer takes ownership.

        Returns:
            True if queued; False if policy ``"drop"`` dropped the block (``k`` records counted).

        Raises:
            Same as :meth:`write`; InvalidArgumentError also when an array's first dimension
            is not ``k``.
        """
        h = self._open_handle(handle_id)
        if type(steps) is list and type(calls) is list and len(steps) == len(calls) and steps:
            # The recorder's case, checked in Python: numpy's checks of a few ints cost ~50 us.
            if all(type(v) is int for v in steps) and all(type(v) is int for v in calls):
                _check_steps(handle_id, steps, calls)
                return self._put(h, steps[:], calls[:], fields, len(steps))  # copies: the caller keeps its lists
        st = np.asarray(steps)
        ca = np.asarray(calls)
        if st.size == 0 and ca.size == 0:
            raise InvalidArgumentError(f"write_block({handle_id!r}): empty block (no steps); write at least one record")
        if st.ndim != 1 or ca.shape != st.shape or st.dtype.kind not in "iu" or ca.dtype.kind not in "iu":
            raise InvalidArgumentError(
                f"write_block({handle_id!r}): steps and calls must be 1-D integer sequences of the same "
                f"length, got steps {st.dtype} {st.shape} and calls {ca.dtype} {ca.shape}")
        steps, calls = st.tolist(), ca.tolist()
        _check_steps(handle_id, steps, calls)
        return self._put(h, steps, calls, fields, len(st))

    def _open_handle(self, handle_id: str) -> _Handle:
        if self._closed or self._closing:
            raise WriterClosedError(f"RunWriter for {str(self.run_dir)!r} is closed; create a new writer")
        if self._error is not None:
            raise self._error
        h = self._handles.get(handle_id)
        if h is None:
            raise UnknownNameError(
                f"unknown handle {handle_id!r}: call add_handle() first (known: {sorted(self._handles)[:20]})")
        return h

    def reserve_fields(self, handle_id: str, fields: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
        """Check that records with these fields would be accepted, before any is queued.

        A recorder calls this when a handle's record layout changes, so a record the writer
        would refuse (a bad field name, a changed dtype or ndim) fails in its own hook instead
        of later, with the records queued behind it. Fields seen for the first time are
        registered with this dtype and ndim, exactly as a first :meth:`write` would.

        Args:
            handle_id: a handle declared with :meth:`add_handle`.
            fields: field name -> ``(dtype_name, record_shape)``.

        Raises:
            UnknownNameError, InvalidArgumentError, HookTypeError: as :meth:`write` would.
        """
        h = self._open_handle(handle_id)
        new: list[tuple[str, str, int]] = []
        for name, (dn, shape) in fields.items():
            dtypes.info(dn)
            if self._check_field(h, name, dn, tuple(shape)):
                new.append((name, dn, len(shape)))
        self._register_fields(h, new)

    def _check_field(self, h: _Handle, name: str, dn: str, shape: tuple[int, ...]) -> bool:
        """Refuse a field whose name is invalid, or whose dtype or ndim differs from its first
        record's. Returns whether the field is new (to register once the whole record passed:
        a refused record must leave no trace)."""
        ndim = len(shape)
        if name not in h.known:
            try:
                check_field_name(name)
            except InvalidArgumentError as e:
                raise InvalidArgumentError(f"handle {h.id!r}: {e}") from None
            if name not in h.field_dtype:  # a continued run knows its fields' dtypes already
                return True
        if h.field_dtype[name] != dn:
            raise InvalidArgumentError(
                f"field {name!r} of {h.id!r} changed dtype from {h.field_dtype[name]} to {dn}; "
                f"a field keeps one dtype (use another field name)")
        if h.field_ndim.get(name, ndim) != ndim:
            raise InvalidArgumentError(
                f"field {name!r} of {h.id!r} changed ndim from {h.field_ndim[name]} to {ndim} "
                f"(record shape {shape}); a field keeps its number of dimensions")
        return name not in h.known

    def _register_fields(self, h: _Handle, new: list[tuple[str, str, int]]) -> None:
        """Register the new fields ``(name, dtype_name, ndim)`` of an accepted record."""
        if new:
            with self._cond:
                for name, dn, ndim in new:
                    h.field_dtype.setdefault(name, dn)
                    h.field_ndim.setdefault(name, ndim)
                    h.known.add(name)

    def _put(self, h: _Handle, steps: list[int], calls: list[int], fields: Mapping[str, FieldValue],
             k: int | None) -> bool:
        """Validate ``fields`` (one record if ``k`` is None, else a block of ``k``) and queue them."""
        handle_id = h.id
        if type(fields) is not dict and not isinstance(fields, Mapping):
            raise HookTypeError(f"fields must be a mapping of field name -> array, got {type(fields).__name__}")
        lead = 0 if k is None else 1
        norm_fields: dict[str, tuple[np.ndarray, str]] = {}
        new: list[tuple[str, str, int]] = []
        nbytes = 0
        for name, v in fields.items():
            if type(v) is tuple:
                if len(v) != 2:
                    raise HookTypeError(f"field {name!r}: expected (raw_bits, dtype_name), got a {len(v)}-tuple")
                arr, dn = v
                inf = dtypes._INFO.get(dn) if isinstance(dn, str) else None
                if inf is None or not inf.is_bits:
                    raise InvalidArgumentError(
                        f"field {name!r}: dtype name {dn!r} is not a raw-bits dtype; use one of {dtypes.BITS_NAMES}")
                if not isinstance(arr, np.ndarray) or arr.dtype.itemsize != inf.storage.itemsize or arr.dtype.kind not in "iu":
                    raise HookTypeError(
                        f"field {name!r}: {dn} bits must be a numpy {inf.storage} array, got "
                        f"{getattr(arr, 'dtype', type(arr).__name__)}")
            elif isinstance(v, (np.ndarray, np.generic)):
                arr = v if type(v) is np.ndarray else np.asarray(v)
                dn = dtypes._BY_NUMPY.get(arr.dtype) or dtypes.native_name(arr.dtype)
            else:
                raise HookTypeError(
                    f"field {name!r}: value must be a numpy array or (raw_bits, dtype_name), got {type(v).__name__}")
            if k is not None and (arr.ndim == 0 or arr.shape[0] != k):
                raise InvalidArgumentError(
                    f"field {name!r} of {handle_id!r}: a block of {k} records needs arrays of shape "
                    f"({k}, ...), got shape {arr.shape}")
            if self._check_field(h, name, dn, arr.shape[lead:]):
                new.append((name, dn, arr.ndim - lead))
            norm_fields[name] = (arr if lead else arr[None], dn)
            nbytes += arr.nbytes
        self._register_fields(h, new)
        n = len(steps)
        with self._cond:
            if self._error is not None:
                raise self._error
            if self._closed or self._closing:  # close() began after _open_handle's unlocked check
                raise WriterClosedError(f"RunWriter for {str(self.run_dir)!r} was closed during write(); "
                                        f"the record was not queued")
            if self._pending and self._pending + nbytes > self.max_buffer_bytes:
                if self.policy == "drop":
                    h.stats.dropped += n
                    if not self._wake_sent:  # the budget is full: the writer must drain now
                        self._wake_sent = True
                        self._urgent += 1
                        self._cond.notify_all()
                    return False
                t0 = time.monotonic()
                self._waiting += 1
                self._cond.notify_all()
                try:
                    while self._pending and self._pending + nbytes > self.max_buffer_bytes:
                        if self._error is not None:
                            raise self._error
                        if not self._thread.is_alive():
                            raise StorageError(f"the writer thread of {str(self.run_dir)!r} died")
                        self._cond.wait(0.5)
                finally:
                    self._waiting -= 1
                    self._stats.blocked_seconds += time.monotonic() - t0
                if self._closed or self._closing:
                    raise WriterClosedError(f"RunWriter for {str(self.run_dir)!r} was closed while write() waited")
            self._pending += nbytes
            if self._pending > self._stats.peak_buffer_bytes:
                self._stats.peak_buffer_bytes = self._pending
            h.stats.records += n
            h.stats.bytes += nbytes
            if not self._queue:
                self._queue_since = time.monotonic()
            self._queue.append(("rec", h, steps, calls, norm_fields, nbytes))
            # Wake the writer thread per batch, not per record: every wake-up is a GIL hand-off
            # that stalls the training thread (measured: waking per record cost 10-15% of a
            # 25 ms step on 2 cores even when the writer discarded the records).
            self._queued_bytes += nbytes
            if self._queued_bytes >= self._wake_bytes and not self._wake_sent:
                self._wake_sent = True
                self._cond.notify_all()
        return True

    # --- control ------------------------------------------------------------------------------------
    def on_own_thread(self) -> bool:
        """Whether the calling thread is one of the writer's own (which must not wait for it)."""
        return threading.current_thread() in (self._thread, self._compactor)

    def _check_open(self) -> None:
        if self._closed or self._closing:
            raise WriterClosedError(f"RunWriter for {str(self.run_dir)!r} is closed; create a new writer")

    def raise_if_failed(self) -> None:
        """Raise the background :class:`StorageError` if the writer failed (cheap, no I/O)."""
        if self._error is not None:
            raise self._error

    def _submit_and_wait(self, kind: str) -> None:
        ev = _Event()
        with self._cond:
            self._queue.append((kind, ev))
            self._urgent += 1
            self._cond.notify_all()
        while not ev.ev.wait(0.5):
            if not self._thread.is_alive():
                raise self._error or StorageError(f"the writer thread of {str(self.run_dir)!r} died")
        if ev.error is not None:
            raise ev.error

    def flush(self) -> None:
        """Block until every record written so far is on disk, fsynced, and readable after a crash.

        Raises:
            WriterClosedError: after :meth:`close`.
            StorageError: a background write failed (records flushed before stay readable).
        """
        self._check_open()
        if self._error is not None:
            raise self._error
        self._submit_and_wait("flush")

    def stats(self) -> WriterStats:
        """A snapshot of the counters."""
        with self._cond:
            s = WriterStats(
                handles={k: HandleStats(**vars(v)) for k, v in self._stats.handles.items()},
                peak_buffer_bytes=self._stats.peak_buffer_bytes,
                max_buffer_bytes=self.max_buffer_bytes,
                blocked_seconds=self._stats.blocked_seconds,
                rotated_segments=self._stats.rotated_segments,
                error=str(self._error) if self._error else None,
            )
        return s

    def close(self) -> WriterStats:
        """Flush, merge each handle's segments into ``<key>.h5``, write the manifest; idempotent.

        Returns:
            The final :class:`WriterStats`.

        Raises:
            StorageError: if the background thread failed (raised by the first ``close`` only;
                everything flushed before the failure stays readable).
        """
        with self._cond:
            first = not (self._closed or self._closing)
            self._closing = True
        if first:
            atexit.unregister(self._atexit)
            try:
                self._submit_and_wait("close")
            except StorageError:
                pass
            finally:
                self._thread.join(timeout=60)
                self._closed = True
                self._close_stats = self.stats()
                try:
                    os.unlink(self.run_dir / f".writer{self._suffix}.lock")  # clean close: no leftovers
                except OSError:
                    pass
                try:
                    os.close(self._lock_fd)  # releases the flock
                except OSError:
                    pass
        else:
            while not self._closed:
                time.sleep(0.01)
        if self._error is not None and not self._error_raised_by_close:
            self._error_raised_by_close = True
            raise self._error
        return self._close_stats or self.stats()

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


    # --- background thread ----------------------------------------------------------------------------
    def _release(self, nbytes: int) -> None:
        if nbytes:
            with self._cond:
                self._pending -= nbytes
                self._cond.notify_all()

    def _fail(self, e: BaseException) -> None:
        if isinstance(e, StorageError):
            err = e
        else:
            n = _errno_of(e)
            where = f" writing {str(self._current_path)!r}" if self._current_path else f" in {str(self.run_dir)!r}"
            code = f" [errno {n} {_errno.errorcode.get(n, '?')}: {os.strerror(n)}]" if n else ""
            err = StorageError(
                f"hookline writer failed{where}{code}: {type(e).__name__}: {_short(e)}. Records flushed before this "
                f"error are safe; {_FIXES.get(n, 'fix the cause')} and start a new writer",
            )
            if n:
                err.errno = n
            err.__cause__ = e
        with self._cond:
            if self._error is None:
                self._error = err
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            with np.errstate(all="ignore"):  # norms of inf/NaN data: no warnings (thread-local)
                self._loop()
        except BaseException as e:  # pragma: no cover - defensive: never leave callers hanging
            self._fail(e)
            with self._cond:
                for it in self._queue:
                    if it[0] in ("flush", "close"):
                        it[1].error = self._error
                        it[1].ev.set()
                self._queue.clear()
                self._pending = 0
                self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._queue and (self._urgent or self._waiting or self._queued_bytes >= self._wake_bytes):
                        break
                    timeout = None
                    if self.autoflush_s is not None:
                        timeout = max(0.0, self._last_flush + self.autoflush_s - time.monotonic())
                        if timeout == 0.0:
                            break
                    if self._waiting and self._staged_total() > 0:
                        break
                    # Records below the batch size are taken WAKE_LATENCY_S after the first
                    # of them was queued (write() does not wake us for them: it stamps the time).
                    since = self._queue_since if self._queue else None
                    left = WAKE_LATENCY_S if since is None else since + WAKE_LATENCY_S - time.monotonic()
                    if self._queue and left <= 0:
                        break
                    left = max(left, 0.001)
                    self._cond.wait(left if timeout is None else min(timeout, left))
                items = self._queue
                self._queue = deque()
                self._queued_bytes = 0
                self._wake_sent = False
                self._urgent = 0
                self._queue_since = None
            while items:
                # popleft: a processed record's arrays must not stay referenced by the batch
                # after their bytes were released from the budget (else memory doubles).
                it = items.popleft()
                kind = it[0]
                if self._error is not None:
                    if kind == "rec":
                        self._release(it[5])
                    elif kind in ("flush", "close"):
                        if kind == "close":
                            self._abort_all()
                        it[1].error = self._error
                        it[1].ev.set()
                        if kind == "close":
                            return
                    continue
                try:
                    if kind == "rec":
                        self._stage(*it[1:])
                    elif kind == "handle":
                        self._start_handle(it[1])
                    elif kind == "flush":
                        self._flush_all(fsync=self.fsync)
                        it[1].ev.set()
                    elif kind == "close":
                        self._close_all()
                        it[1].ev.set()
                        return
                except BaseException as e:
                    self._fail(e)
                    if kind in ("flush", "close"):
                        if kind == "close":
                            self._abort_all()
                        it[1].error = self._error
                        it[1].ev.set()
                        if kind == "close":
                            return
            if self._error is not None:
                continue
            try:
                if self._manifest_dirty():
                    self._write_manifest("open")
                if self.autoflush_s is not None and time.monotonic() - self._last_flush >= self.autoflush_s:
                    self._flush_all(fsync=self.fsync)
                self._relieve_memory()
            except BaseException as e:
                self._fail(e)

    # --- staging and writing ----------------------------------------------------------------------------
    _dirty = False

    def _manifest_dirty(self) -> bool:
        return self._dirty

    def _start_handle(self, h: _Handle) -> None:
        """Find data of this handle already on disk (continued run) and record where to append."""
        h.started = True
        parts = discover_files(self.run_dir, h.key, h.suffix)
        for rel in parts.cover:
            path = self.run_dir / rel.name
            if rel.kind == "final":
                h.base.append(path)
            else:
                h.sealed.append(_Seg(rel.start, rel.end, path, path.stat().st_size))
        for rel in parts.superseded:
            # Inputs of a merge whose output was renamed into place before a crash: every record
            # is in a covering file, so they go now (close() promises one file per handle).
            if any(c.start <= rel.start and rel.end <= c.end for c in parts.cover):
                (self.run_dir / rel.name).unlink(missing_ok=True)
        for rel_name in parts.leftovers:
            # Outputs of merges a crash interrupted: copies of records still in their inputs
            # (inputs are removed only after the output is published). This writer holds the run's
            # lock, so no merge is running on them.
            (self.run_dir / rel_name).unlink(missing_ok=True)
        h.next_record = parts.end
        h.stats.flushed = h.stats.start = parts.end
        self._dirty = True

    def _open_segment(self, h: _Handle) -> _OpenSeg:
        while len(self._open_lru) >= self.max_open_files:
            self._rotate(next(iter(self._open_lru.values())))
        rel = partial_segment_name(h.key, h.suffix, h.next_record)
        path = self.run_dir / rel
        self._current_path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        attrs = self._file_attrs(h)
        seg = _OpenSeg(h.next_record, path, HandleFileWriter(path, attrs, h.next_record, self._writeback))
        h.seg = seg
        self._open_lru[h.id] = h
        return seg

    def _rotate(self, h: _Handle) -> None:
        """Seal ``h``'s open segment to free its file (max_open_files). Not fsynced now (that would
        cost an fsync per rotation): :meth:`_flush_all` fsyncs it with the next flush."""
        done = self._finish_segment(h)
        if done is not None:
            final = self._publish_segments([done], fsync=False)[0]
            if self.fsync:  # (without fsync nothing is synced: keeping the paths would only grow)
                self._unsynced.append(final)
            self._stats.rotated_segments += 1

    def _file_attrs(self, h: _Handle) -> dict[str, Any]:
        i = h.info
        return {
            "handle_id": h.id, "key": h.key, "module_name": i["module_name"], "module_type": i["module_type"],
            "category": i["category"], "hook_fn_name": i["hook_fn_name"],
            "rank": np.int64(-1 if self.rank is None else self.rank),
            "world_size": np.int64(-1 if self.world_size is None else self.world_size),
            "hookline_version": hookline_version(), "meta": json.dumps(i["meta"]),
            "run_meta": json.dumps(self.meta), "created": now_iso(),
            "run_uuid": self._uuid, "run_created": self._created,  # (a lost manifest is rebuilt)
        }

    def _stage(self, h: _Handle, steps: list[int], calls: list[int],
               fields: dict[str, tuple[np.ndarray, str]], nbytes: int) -> None:
        """Stage a block of ``len(steps)`` records (arrays ``(k, *shape)``); write full chunks."""
        seg = h.seg
        k = len(steps)
        # Shape changes: a field becomes ragged for good. If this segment already holds it as a
        # fixed-shape dataset, seal the segment first (merges rewrite the field ragged).
        need_seal = False
        for name, (arr, _) in fields.items():
            if name in h.ragged:
                continue
            shape = arr.shape[1:]
            known = h.shapes.get(name)
            if known is None:
                h.shapes[name] = shape
                if 0 in shape:
                    h.ragged.add(name)
            elif known != shape:
                h.ragged.add(name)
                if seg is not None and name in seg.fields and not seg.fields[name].spec.ragged:
                    need_seal = True
        if need_seal:
            self._seal(h, fsync=self.fsync)  # flush() will not see this segment again
            seg = None
        if seg is None:
            seg = self._open_segment(h)
        else:
            self._open_lru.move_to_end(h.id)
        rec = h.next_record
        h.next_record += k
        seg.steps.extend(steps)
        seg.calls.extend(calls)
        lo, hi = min(steps), max(steps)
        h.steps_min = lo if h.steps_min is None else min(h.steps_min, lo)
        h.steps_max = hi if h.steps_max is None else max(h.steps_max, hi)
        for name, (arr, dn) in fields.items():
            sf = seg.fields.get(name)
            if sf is None:
                spec = FieldSpec(name, dn, name in h.ragged, arr.shape[1:], self._compression_for(name))
                sf = seg.fields[name] = _StagedField(spec)
            if not arr.flags.c_contiguous or not arr.dtype.isnative:
                arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("="))
            if sf.spec.info.storage != arr.dtype:
                arr = arr.view(sf.spec.info.storage)  # signed bits -> unsigned storage, same width
            sf.records.extend(range(rec, rec + k))
            if sf.spec.ragged:
                for one in arr:
                    if sf.spec.info.has_norm:
                        sf.norms.append(_l2(one, dn))  # fixed fields: per block in _write_items
                    sf.offsets.append(sf.written_items + sf.staged_items)
                    sf.shapes.append(one.shape)
                    flat = one.reshape(-1)
                    sf.arrays.append(flat)
                    sf.staged_items += flat.size
            else:
                sf.arrays.append(arr)  # a run of k records, written (or split) by _write_items
                sf.staged_items += k
            sf.staged_bytes += arr.nbytes
            if sf.out is None or sf.chunk_items == 1:
                if sf.staged_bytes >= (1 << 20) or (not sf.spec.ragged and sf.staged_items >= 1 << 16):
                    self._write_out(seg, sf, full_only=True)
            elif sf.written_items % sf.chunk_items + sf.staged_items >= sf.chunk_items:
                self._write_out(seg, sf, full_only=True)
        h.written_bytes += nbytes

    def _ensure_out(self, seg: _OpenSeg, sf: _StagedField) -> None:
        if sf.out is None:
            # Size chunks for what is staged, but not below 64 KiB (a small first flush must not
            # leave the rest of the segment with tiny chunks).
            floor = max(1, (64 << 10) // max(1, sf.item_bytes))
            sf.out = seg.writer.field(sf.spec, max(sf.staged_items, floor))
            sf.chunk_items = sf.out.chunk[0]

    def _scratch_view(self, nbytes: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(max(nbytes, 2 * self._scratch.nbytes), np.uint8)
        return self._scratch[:nbytes].view(dtype).reshape(shape)

    def _write_out(self, seg: _OpenSeg, sf: _StagedField, full_only: bool) -> None:
        """Write staged items of one field: up to the last chunk boundary (``full_only``) or all."""
        if not sf.staged_items:
            return
        self._ensure_out(seg, sf)
        c = sf.chunk_items
        if full_only:
            k = ((sf.written_items + sf.staged_items) // c) * c - sf.written_items
            if k <= 0:
                return
        else:
            k = sf.staged_items
        piece = max(c, _PIECE_BYTES // max(1, sf.item_bytes))
        while k > piece:
            self._write_items(seg, sf, piece)
            k -= piece
        self._write_items(seg, sf, k)

    def _write_items(self, seg: _OpenSeg, sf: _StagedField, k: int) -> None:
        """Write the first ``k`` staged items of a field (one resize + one write / direct chunks)."""
        spec = sf.spec
        st = spec.info.storage
        self._current_path = seg.partial
        parts = _take(sf.arrays, k)
        if not spec.ragged and sf.out.direct and sf.chunk_items == 1:
            if spec.info.has_norm:
                for p in parts:
                    sf.norms.extend(_row_norms(p, spec.dtype_name))
            sf.out.append_records([r for p in parts for r in p])
            released = k * sf.item_bytes
        else:
            if len(parts) == 1:
                block = parts[0]  # a whole run (e.g. a recorder's chunk-sized block): no copy
            else:
                # One call: one GIL release, not one per run.
                shape = (k,) if spec.ragged else (k, *spec.shape)
                block = self._scratch_view(k * (st.itemsize if spec.ragged else sf.item_bytes), st, shape)
                np.concatenate(parts, axis=0, out=block)
            if not spec.ragged and spec.info.has_norm:
                # One batched computation per block: per-record numpy calls would release and
                # re-acquire the GIL once per record (measured 20 us each under contention).
                sf.norms.extend(_row_norms(block, spec.dtype_name))
            sf.out.append(block)
            released = k * (st.itemsize if spec.ragged else sf.item_bytes)
        del parts
        sf.staged_items -= k
        sf.written_items += k
        sf.staged_bytes -= released
        if self.test_delay_s_per_mb:
            time.sleep(self.test_delay_s_per_mb * released / (1 << 20))
        self._release(released)

    def _staged_total(self) -> int:
        total = 0
        for h in list(self._handles.values()):  # snapshot: add_handle() inserts concurrently
            if h.seg is not None:
                total += sum(sf.staged_bytes for sf in h.seg.fields.values())
        return total

    def _relieve_memory(self) -> None:
        """Write partial chunks when staged data would starve the budget (or a caller waits)."""
        limit = self.max_buffer_bytes // 2
        with self._cond:
            waiting = self._waiting
        staged = [(sf.staged_bytes, h, sf) for h in list(self._handles.values()) if h.seg is not None
                  for sf in h.seg.fields.values() if sf.staged_bytes]
        total = sum(s[0] for s in staged)
        if not waiting and total <= limit:
            return
        staged.sort(key=lambda s: -s[0])
        for nb, h, sf in staged:
            if total <= limit // 2 and not waiting:
                break
            self._write_out(h.seg, sf, full_only=False)
            total -= nb

    def _seal(self, h: _Handle, fsync: bool) -> None:
        """Write everything staged of ``h``'s open segment, close it and rename it to ``.h5seg``."""
        done = self._finish_segment(h)
        if done is not None:
            self._publish_segments([done], fsync)

    def _finish_segment(self, h: _Handle) -> tuple[_Handle, Path, int, int] | None:
        """Write what is staged of ``h``'s open segment and its indexes; close the file (still
        ``.partial``). Returns ``(h, partial path, start, end)`` for :meth:`_publish_segments`."""
        seg = h.seg
        if seg is None:
            return None
        self._current_path = seg.partial
        w = seg.writer
        for sf in seg.fields.values():
            self._write_out(seg, sf, full_only=False)
            self._ensure_out(seg, sf)
            out = sf.out
            out.records.append(np.asarray(sf.records, np.int64))
            if sf.spec.info.has_norm:
                out.norms.append(np.asarray(sf.norms, np.float64))
            if sf.spec.ragged:
                out.offsets.append(np.asarray(sf.offsets, np.int64))
                out.shapes.append(np.asarray(sf.shapes, np.int64).reshape(len(sf.shapes), sf.spec.ndim))
        w.add_index(np.asarray(seg.steps, np.int64), np.asarray(seg.calls, np.int64))
        w.finish()
        h.seg = None
        self._open_lru.pop(h.id, None)
        self._current_path = None
        return h, seg.partial, seg.start, seg.start + len(seg.steps)

    def _publish_segments(self, done: list[tuple[_Handle, Path, int, int]], fsync: bool) -> list[Path]:
        """Publish finished segments as ``.h5seg`` files and add them to their handles; returns
        their paths."""
        finals = [self.run_dir / segment_name(h.key, h.suffix, start, end) for h, _, start, end in done]
        self._current_path = done[0][1]
        _publish([(d[1], final) for d, final in zip(done, finals)], fsync)
        for (h, _, start, end), final in zip(done, finals):
            with self._seg_lock:
                h.sealed.append(_Seg(start, end, final, final.stat().st_size))
            h.stats.flushed = end
        self._current_path = None
        return finals

    def _flush_all(self, fsync: bool) -> None:
        done = []
        if fsync and self._unsynced:
            self._sync_rotated()
        try:
            for h in list(self._handles.values()):
                d = self._finish_segment(h)
                if d is not None:
                    done.append(d)
        finally:  # segments finished before a failure are still published
            if done:
                self._publish_segments(done, fsync)
        self._write_manifest("open")
        self._last_flush = time.monotonic()
        with self._compact_cond:
            self._compact_wanted = True
            self._compact_cond.notify_all()
        if self._compact_error is not None:
            e, self._compact_error = self._compact_error, None
            raise e

    def _sync_rotated(self) -> None:
        """fsync the segments sealed by :meth:`_rotate` since the last flush (and their folders)."""
        paths, self._unsynced = self._unsynced, []
        for path in paths:
            self._current_path = path
            try:
                fsync_file(path)
            except FileNotFoundError:
                pass  # merged away by the compactor since: its output was fsynced
        for d in {p.parent for p in paths}:
            fsync_dir(d)
        self._current_path = None

    def _abort_all(self) -> None:
        self._open_lru.clear()
        for h in list(self._handles.values()):
            if h.seg is not None:
                h.seg.writer.abort()
                h.seg = None
        self._stop_compactor()
        try:
            self._write_manifest("failed")
        except Exception:
            pass

    def _stop_compactor(self) -> None:
        with self._compact_cond:
            self._compact_stop = True
            self._compact_cond.notify_all()
        self._compactor.join()

    def _close_all(self) -> None:
        self._flush_all(fsync=self.fsync)
        self._stop_compactor()
        if self._compact_error is not None:
            raise self._compact_error
        if self.merge_on_close:
            for h in list(self._handles.values()):
                self._finalize(h)
        self._write_manifest("closed")

    def _finalize(self, h: _Handle) -> None:
        """Merge a handle's complete files into ``<key>.h5`` (rename when there is one segment)."""
        final = self.run_dir / final_name(h.key, h.suffix)
        self._current_path = final
        segs = list(h.sealed)
        if not segs and h.base:
            return  # nothing new since the run was continued
        if not h.base and len(segs) == 1 and segs[0].start == 0:
            os.replace(segs[0].path, final)
            if self.fsync:
                fsync_dir(final.parent)
        else:
            tmp = final.with_name(final.name + ".partial")
            if not h.base and not segs:
                final.parent.mkdir(parents=True, exist_ok=True)
                HandleFileWriter(tmp, self._file_attrs(h), 0).finish()
            else:
                self._merge_files(h, [*h.base, *(s.path for s in segs)], tmp)
            _publish([(tmp, final)], self.fsync)
            for s in segs:
                s.path.unlink(missing_ok=True)
        with self._seg_lock:
            h.sealed = []
            h.base = [final]
        h.final_done = True
        self._current_path = None

    # --- compaction (own thread; only touches sealed, immutable segment files) -------------------------
    def _compact_loop(self) -> None:
        while True:
            with self._compact_cond:
                while not self._compact_wanted and not self._compact_stop:
                    self._compact_cond.wait()
                if self._compact_stop:
                    return
                self._compact_wanted = False
            try:
                for h in list(self._handles.values()):
                    while not self._compact_stop:
                        with self._seg_lock:
                            pick = _pick_merge([s.nbytes for s in h.sealed])
                            run = list(h.sealed[pick[0] : pick[1]]) if pick else None
                        if not run:
                            break
                        self._merge_segments(h, run)
            except BaseException as e:
                self._compact_error = e
                return

    def _merge_files(self, h: _Handle, paths: list, out: Path, record_start: int = 0) -> None:
        """Copy the records of the complete files ``paths`` (in order) into the new file ``out``,
        with at most ``MERGE_MAX_FILES`` inputs open at once."""
        merge_files(list(paths), out, self._file_attrs(h), self._compression_for, record_start=record_start,
                    writeback=self._writeback_bytes,
                    mid_path=lambda a, b: self.run_dir / merge_output_name(h.key, h.suffix, a, b))

    def _merge_segments(self, h: _Handle, run: list[_Seg]) -> None:
        start, end = run[0].start, run[-1].end
        out = self.run_dir / segment_name(h.key, h.suffix, start, end)
        tmp = self.run_dir / merge_output_name(h.key, h.suffix, start, end)
        self._merge_files(h, [s.path for s in run], tmp, record_start=start)
        _publish([(tmp, out)], self.fsync)
        with self._seg_lock:
            i = h.sealed.index(run[0])
            h.sealed[i : i + len(run)] = [_Seg(start, end, out, out.stat().st_size)]
        for s in run:
            s.path.unlink(missing_ok=True)

    # --- manifest -------------------------------------------------------------------------------------
    def _manifest(self, status: str) -> dict[str, Any]:
        handles: dict[str, Any] = dict(self._old_handles)
        for hid in self._order:
            h = self._handles[hid]
            old = self._old_handles.get(hid, {})
            fields = dict(old.get("fields", {}))
            for name, dn in list(h.field_dtype.items()):
                if name in h.shapes or name in h.ragged:
                    shape = None if name in h.ragged else list(h.shapes[name])
                    prev = fields.get(name)
                    if prev is not None and prev.get("shape") != shape:
                        shape = None
                    fields[name] = {"dtype": dn, "shape": shape, "ndim": h.field_ndim.get(name)}
            steps = old.get("steps")
            if h.steps_min is not None:
                lo, hi = h.steps_min, h.steps_max
                if steps:
                    lo, hi = min(lo, steps[0]), max(hi, steps[1])
                steps = [lo, hi]
            handles[hid] = {
                "key": h.key, "file": final_name(h.key, h.suffix),
                **{k: h.info[k] for k in ("module_name", "module_type", "category", "hook_fn_name")},
                "records": h.stats.flushed, "bytes": int(old.get("bytes", 0)) + h.written_bytes,
                "dropped": int(old.get("dropped", 0)) + h.stats.dropped,
                "steps": steps, "fields": fields, "meta": h.info["meta"],
                "segments": len(h.sealed) if not h.final_done else 0,
            }
        return {
            "format": RUN_FORMAT, "format_version": FORMAT_VERSION, "hookline_version": hookline_version(),
            "created": self._created, "updated": now_iso(), "status": status, "run_uuid": self._uuid,
            "rank": self.rank, "world_size": self.world_size, "meta": self.meta,
            "dropped": sum(int(v.get("dropped", 0)) for v in handles.values()),
            "error": str(self._error) if self._error else None,
            "handles": handles,
        }

    def _write_manifest(self, status: str) -> None:
        self._current_path = self._manifest_path
        m = self._manifest(status)
        try:
            json.dumps(m)
        except (TypeError, ValueError):
            m["meta"] = self.meta
        atomic_write_json(self._manifest_path, m, fsync=self.fsync)
        self._dirty = False
        self._current_path = None


def _differs(a: Any, b: Any) -> bool:
    """Whether two JSON metadata values differ (NaN == NaN here: compared as JSON text too)."""
    return a != b and json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True)


def json_meta(meta: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    """``meta`` as plain JSON data, checked: numpy values (and anything else with ``tolist()``,
    e.g. a 0-dim tensor) become lists and scalars; anything JSON cannot store is refused, naming
    its key, instead of being stored as its ``str()``.

    Raises:
        HookTypeError: ``meta`` is not a mapping with str keys, or a value cannot be stored.
    """
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise HookTypeError(f"{what} must be a dict, got {type(meta).__name__} {meta!r:.80}")

    def plain(o: Any) -> Any:
        tolist = getattr(o, "tolist", None)
        if callable(tolist):
            return tolist()
        raise TypeError(type(o).__name__)

    out: dict[str, Any] = {}
    for k, v in meta.items():
        if not isinstance(k, str):
            raise HookTypeError(f"{what}: keys must be str, got {type(k).__name__} {k!r:.80}")
        try:
            out[k] = json.loads(json.dumps(v, default=plain, allow_nan=True))
        except (TypeError, ValueError) as e:
            raise HookTypeError(
                f"{what}: the value of {k!r} ({type(v).__name__} {v!r:.60}) cannot be stored as JSON ({e}); "
                f"pass numbers, strings, lists or dicts (e.g. str(value) for its text)") from None
    return out


def _lock_run(run_dir: Path, suffix: str) -> int:
    """Take an exclusive ``flock`` on ``<run_dir>/.writer<suffix>.lock`` (released on close or
    process death) so two writers never write the same rank of a run at once."""
    import fcntl

    path = run_dir / f".writer{suffix}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise StorageError(f"cannot create lock file {str(path)!r}: {e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (_errno.EWOULDBLOCK, _errno.EAGAIN, _errno.EACCES):
            return fd  # file system without flock (e.g. some NFS): run unlocked
        os.close(fd)
        raise StorageError(
            f"another RunWriter is writing {str(run_dir)!r}{' (' + suffix[1:] + ')' if suffix else ''} "
            f"(lock {str(path)!r} is held): close it first, or use another run directory / rank"
        ) from None
    return fd


def weak_closer(obj: Any, on_error: Callable[[Any, Exception], None] | None = None) -> Callable[[], None]:
    """An ``atexit`` callback that closes ``obj`` if it is still alive and open, without keeping
    it alive. Errors go to ``on_error(obj, exc)`` (default: ignored; at exit there is no caller
    left to raise to). Used by :class:`RunWriter` and the tracker's ``Recorder``."""
    ref = weakref.ref(obj)

    def close() -> None:
        o = ref()
        if o is not None and not o._closed:
            try:
                o.close()
            except Exception as e:
                if on_error is not None:
                    on_error(o, e)

    return close


def _pick_merge(sizes: list[int]) -> tuple[int, int] | None:
    """Pick a trailing run of sealed segments to merge (size-tiered, like an LSM tree).

    Nothing while there are fewer than :data:`COMPACT_MIN_SEGMENTS`. Otherwise the newest
    :data:`COMPACT_FANIN` segments, extended to the left while the segment before them is smaller
    than their total, so merged segments grow geometrically and every byte is copied
    O(log n) times. Returns ``(start, stop)`` slice bounds or None.
    """
    n = len(sizes)
    if n < max(COMPACT_FANIN, COMPACT_MIN_SEGMENTS):
        return None
    i = n - COMPACT_FANIN
    total = sum(sizes[i:])
    while i > 0 and sizes[i - 1] < total:
        i -= 1
        total += sizes[i]
    return (i, n)


def _publish(pairs: list[tuple[Path, Path]], fsync: bool) -> None:
    """Make complete files visible under their final names: (fsync each,) atomic renames, (fsync
    each directory once: a flush of many handles mostly shares one or two directories)."""
    if fsync:
        for tmp, _ in pairs:
            fsync_file(tmp)
    for tmp, final in pairs:
        os.replace(tmp, final)
    if fsync:
        for d in {final.parent for _, final in pairs}:
            fsync_dir(d)


def _take(runs: deque, k: int) -> list[np.ndarray]:
    """Pop the first ``k`` items (along axis 0) off a deque of staged runs, splitting a run
    when needed; returns the pieces in order."""
    parts = []
    while k:
        a = runs[0]
        if len(a) <= k:
            parts.append(runs.popleft())
            k -= len(a)
        else:
            parts.append(a[:k])
            runs[0] = a[k:]
            k = 0
    return parts


def _row_norms(block: np.ndarray, dn: str) -> list[float]:
    """L2 norm of every record of a ``(k, ...)`` block (batched BLAS; float64 retry on
    overflow/underflow)."""
    k = block.shape[0]
    if block.size == 0:
        return [0.0] * k
    if dn in ("float32", "float64"):
        x = block.reshape(k, -1)
    elif dn in ("complex64", "complex128"):
        x = block.reshape(k, -1).view(np.float32 if dn == "complex64" else np.float64)
    else:
        x = dtypes.to_float(block, dn).reshape(k, -1)
        if x.dtype.kind == "c":
            x = x.view(np.float32)
    s = (x[:, None, :] @ x[:, :, None]).reshape(k).astype(np.float64)
    bad = ~np.isfinite(s) | (s < 1e-30)
    if bad.any():
        x64 = x[bad].astype(np.float64)
        s[bad] = (x64[:, None, :] @ x64[:, :, None]).reshape(-1)
    return np.sqrt(s).tolist()


def _l2(arr: np.ndarray, dn: str) -> float:
    """L2 norm of one record, accumulated in float32 (BLAS) with a float64 retry on overflow/underflow."""
    if arr.size == 0:
        return 0.0
    if dn in ("float32", "float64"):
        x = arr.reshape(-1)
    elif dn in ("complex64", "complex128"):
        x = arr.reshape(-1).view(np.float32 if dn == "complex64" else np.float64)
    else:
        x = dtypes.to_float(arr, dn).reshape(-1)
        if x.dtype.kind == "c":
            x = x.view(np.float32)
    s = float(np.dot(x, x))
    if not math.isfinite(s) or s < 1e-30:
        x64 = x.astype(np.float64)
        s = float(np.dot(x64, x64))
    return math.sqrt(s) if s == s else float("nan")
