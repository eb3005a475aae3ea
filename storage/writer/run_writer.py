"""The public face of the buffered background writer: :class:`RunWriter` (design in docs/storage.md).

The training thread calls :meth:`RunWriter.write`, which only validates, accounts the bytes
against ``max_buffer_mb`` and appends to an in-memory queue (microseconds, no HDF5 call). One
background thread (:mod:`.thread`) stages records per field and writes whole chunks; h5py
releases the GIL inside HDF5 calls, so the training thread keeps running. Records go into parts
(segment files) that are sealed (``.h5seg.partial`` -> ``.h5seg``) at every :meth:`flush`, so a
SIGKILL never leaves a flushed record in a file that may not open. A second thread compacts
sealed parts; a clean :meth:`close` merges them into one ``<key>.h5`` per handle.
"""

from __future__ import annotations

import atexit
import json
import operator
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .. import dtypes
from .._filters import CompressionRules
from .._fs import Writeback, check_max_open_files, lock_run, open_files_share, unlock_run
from ..budget import Budget
from ..errors import HookTypeError, InvalidArgumentError, StorageError, UnknownNameError, WriterClosedError
from ..format import manifest_name, rank_suffix
from ..keys import handle_key
from ..lifecycle import weak_closer
from ..priority import check_priority
from ..live import AUTOFLUSH_S
from .checks import AUTOFLUSH_FIX, FieldValue, check_handle_names, check_seconds, check_steps, checked_fields, \
    json_meta, meta_conflicts
from .context import WriterContext
from .handle import NewField, WriterHandle
from .manifest import ManifestWriter, RunIdentity
from .queue import Close, Flush, NewHandle, Record, WriteQueue
from .staging import FileSlots, PartTools
from .stats import HandleStats, WriterStats
from .thread import WriterThread

__all__ = ["RunWriter"]

_POLICIES = ("block", "drop")


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
            seconds passed since the last flush, bounding what a crash can lose and how long a
            live run looks empty to readers; None disables. Default 60. A positive finite number
            (else ``InvalidArgumentError``, before anything is created).
        merge_on_close: merge each handle's segments into one ``<key>.h5`` at :meth:`close`.
            With False, segments stay (readable by ``open_run``; ``verify(repair=True)`` merges).
        fsync: fsync files and directories at flush/close (power-loss durability).
        writeback_mb: every this many MB written (over all open files), ask the kernel to start
            writing them to disk (asynchronously) and to drop their pages already on disk. Keeps the
            disk busy while the run goes on, so ``flush()``/``close()`` find little left to
            sync and a long run does not fill the page cache; 0 or None leaves writeback to
            the kernel. See docs/storage.md.
        max_open_files: most segment files open at once. Each handle written since the last
            flush has one segment; beyond this many, the least recently written one's file is
            parked (closed, reopened when its handle writes again: one segment per handle per
            flush whatever the number of handles). Each open file costs HDF5 ~0.55 MB, counted
            against ``max_buffer_mb``. None (default): as many as an eighth of the budget pays
            for (at least 4), at most half the open-file limit (``ulimit -n``) minus 64.
        checksums: store an xxh3-64 hash of every chunk of every field beside its index,
            computed on the writer thread from the memory handed to HDF5 (docs/format.md, "Chunk
            hashes"; ``verify`` checks them). False: live segments carry none (a merged file,
            at close or by compaction, always does).
        writer_priority: the scheduling priority of the writer's background threads (Linux):
            ``"normal"`` (the caller's, the default here) or ``"nice"`` (nice 19, the Recorder's
            default); see docs/internals/capture.md, "The writer's priority". Elsewhere always
            normal.

    Example:
        >>> w = RunWriter("runs/a", max_buffer_mb=256)
        >>> w.add_handle("outputs[fc]", module_name="fc", module_type="torch.nn.Linear",
        ...              category="forward_hook", hook_fn_name="outputs")
        >>> w.write("outputs[fc]", 0, 0, {"outputs.0": np.ones((4, 8), np.float32)})
        True
        >>> stats = w.close()
    """

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
        autoflush_s: float | None = AUTOFLUSH_S,
        merge_on_close: bool = True,
        fsync: bool = True,
        writeback_mb: float | None = 32,
        max_open_files: int | None = None,
        checksums: bool = True,
        writer_priority: str = "normal",
    ) -> None:
        if policy not in _POLICIES or not isinstance(checksums, bool):
            raise InvalidArgumentError(f"policy must be 'block' or 'drop' and checksums a bool, got policy={policy!r}, "
                                       f"checksums={checksums!r:.40}")
        self.budget = Budget(max_buffer_mb)
        writer_priority = check_priority(writer_priority)
        _check_ranks(rank, world_size)
        if writeback_mb is not None and (
            isinstance(writeback_mb, bool) or not isinstance(writeback_mb, (int, float)) or writeback_mb < 0
        ):
            raise InvalidArgumentError(
                f"writeback_mb must be a number >= 0 or None (0/None: leave writeback to the kernel), got {writeback_mb!r}"
            )
        # At most half of the open-file limit (torch, sockets, readers and merges need files too);
        # by default as many as an eighth of the budget pays for (each costs HDF5 ~0.55 MB).
        if max_open_files is None:
            self.max_open_files = self.budget.open_files(open_files_share(2, 1024))
        else:
            self.max_open_files = check_max_open_files(max_open_files, 2, 1024)
        compression_rules = CompressionRules(compression)
        autoflush_s = check_seconds(autoflush_s, "autoflush_s", AUTOFLUSH_FIX)
        self.meta = json_meta(meta, "run meta")  # before anything is created
        self.run_dir = Path(run_dir)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create run directory {str(self.run_dir)!r}: {e}") from e
        self.rank, self.world_size = rank, world_size
        self.policy = policy
        self.max_buffer_bytes = self.budget.bytes
        self.autoflush_s = autoflush_s
        self.merge_on_close = merge_on_close
        self.fsync = fsync
        self._suffix = rank_suffix(rank, world_size)
        self._lock_fd = lock_run(self.run_dir, self._suffix)
        manifest_path = self.run_dir / manifest_name(rank, world_size)
        # uuid: identifies the run directory (e.g. to an MLflow run); a continued run keeps its own.
        self._identity = RunIdentity.load(self.run_dir, manifest_path, rank, world_size, self.meta, uuid.uuid4().hex)
        self._handles: dict[str, WriterHandle] = {}  # declaration order
        self._stats = WriterStats(max_buffer_bytes=self.max_buffer_bytes)
        self._queue = WriteQueue(self.budget, policy, self._stats, str(self.run_dir),
                                 max_bytes=self.budget.queue_bytes(self.max_open_files))
        self._closed = False
        self._error_raised_by_close = False
        self._close_stats: WriterStats | None = None
        writeback_bytes = int((writeback_mb or 0) * (1 << 20))
        ctx = WriterContext(self.run_dir, fsync, compression_rules, writeback_bytes,
                            Writeback(writeback_bytes), self._identity,
                            PartTools(self._queue.release, FileSlots(self.max_open_files, self._stats),
                                      root=self.run_dir, hashes=checksums), writer_priority)
        manifest = ManifestWriter(manifest_path, self._identity, fsync)
        self._thread = WriterThread(ctx, self._queue, self._handles, self._stats, self.budget, manifest,
                                    autoflush_s=autoflush_s, merge_on_close=merge_on_close)
        self._thread.start()
        # Close at interpreter exit (atexit runs while daemon threads still run), weakly.
        self._atexit = weak_closer(self)  # errors: reported through the manifest
        atexit.register(self._atexit)

    # --- handles ----------------------------------------------------------------------------------
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
            category: ``"forward_hook"``, ``"forward_pre_hook"``, ``"backward_hook"``, or ``""``
                (not a hook: data written by other means).
            hook_fn_name: the hook function's name.
            meta: JSON-serialisable per-handle metadata.

        Raises:
            InvalidArgumentError: the id or a name contains a control character or is too long
                (:func:`~hookline.storage.keys.check_name`), ``category`` is not one of the
                above, or ``meta`` differs from the handle's earlier metadata.
            HookTypeError: the id is not a str, or ``meta`` cannot be stored as JSON.
        """
        self._check_open()
        names = {"module_name": str(module_name), "module_type": str(module_type),
                 "category": str(category), "hook_fn_name": str(hook_fn_name)}
        check_handle_names(handle_id, names)
        key = handle_key(handle_id)
        new_meta = json_meta(meta, f"meta of handle {handle_id!r}")
        previous = self._identity.previous
        with self._queue.cond:
            old = self._handles.get(handle_id)
            if old is None and handle_id in previous:  # a continued run's handle
                old_meta = previous[handle_id].get("meta")
            else:
                old_meta = old.info["meta"] if old is not None else None
            if isinstance(old_meta, dict):
                changed = meta_conflicts(old_meta, new_meta)
                if changed:
                    raise InvalidArgumentError(
                        f"handle {handle_id!r} already records with {', '.join(f'{k}={a!r}' for k, (a, _) in changed.items())}"
                        f" in {str(self.run_dir)!r}; records with {', '.join(f'{k}={b!r}' for k, (_, b) in changed.items())}"
                        f" would be mixed into it: give the hook another name")
            if old is not None:
                return
            info = {**names, "meta": new_meta}
            h = WriterHandle(handle_id, key, self._suffix, info)
            h.adopt_fields(previous.get(handle_id, {}).get("fields", {}))
            self._handles[handle_id] = h
            self._stats.handles[handle_id] = h.stats
            self._queue.charge(Budget.HANDLE_BYTES)  # its state is memory too (SPEC §8)
            self._queue.put_urgent(NewHandle(h))

    def update_handle_meta(self, handle_id: str, meta: Mapping[str, Any]) -> None:
        """Merge keys into a declared handle's metadata (e.g. fields discovered while recording).

        The manifest carries the merged metadata from the next flush/close on, and so do the
        attributes of files the writer creates afterwards; the manifest is authoritative.

        Raises:
            UnknownNameError: the handle was not declared with :meth:`add_handle`.
            HookTypeError: ``meta`` is not JSON-serialisable.
        """
        self._check_open()
        with self._queue.cond:
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

    # --- hot path ---------------------------------------------------------------------------------
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
        check_steps(handle_id, steps, calls)
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
        steps, calls = self._block_steps(handle_id, steps, calls)
        return self._put(h, steps, calls, fields, len(steps))

    def write_rows(self, handle_ids: Any, steps: Any, calls: Any, fields: Mapping[str, FieldValue]) -> bool:
        """Queue ``k`` records of several handles with the same fields at once: record ``j``
        belongs to ``handle_ids[j]`` (one queue entry, one validation of the arrays).

        Each handle's records are numbered in block order, exactly as :meth:`write` calls in that
        order would number them. A recorder with more hooked handles than its open blocks hold
        chunks for packs their records into such blocks (docs/capture.md).

        Args:
            handle_ids: ``k`` declared handle ids (repeats allowed).
            steps, calls: ``k`` non-negative ints each.
            fields: field name -> array of shape ``(k, *record_shape)`` (or raw bits); every
                handle must accept these fields (dtype and ndim as its earlier records).

        Returns:
            True if queued; False if policy ``"drop"`` dropped the block (each record counted for
            its handle).

        Raises:
            Same as :meth:`write_block`; nothing is queued or registered when any handle refuses.
        """
        if not isinstance(handle_ids, (list, tuple)) or not handle_ids:
            raise InvalidArgumentError(f"write_rows: handle_ids must be a non-empty list of handle ids, "
                                       f"got {handle_ids!r:.80}")
        k = len(handle_ids)
        first = self._open_handle(handle_ids[0])  # (closed or failed: raised here, once)
        known = self._handles
        try:
            rows = [known[hid] for hid in handle_ids]
        except (KeyError, TypeError):  # (an unhashable id: the error _open_handle gives)
            for hid in handle_ids:
                self._open_handle(hid)
            raise
        steps, calls = self._block_steps(handle_ids[0], steps, calls)
        if len(steps) != k:
            raise InvalidArgumentError(f"write_rows: {k} handle ids but {len(steps)} steps; give one per record")
        checked, new, nbytes = checked_fields(first, fields, k)
        news = [(first, new)]
        # The arrays were checked once; each other handle checks its field registry. A handle
        # that knows every field with this dtype and ndim (every record of a run but its first)
        # costs a few lookups: this loop runs per record of a shared block.
        layout = [(n, dn, a.ndim - 1, a.shape[1:]) for n, (a, dn) in checked.items()]
        for h in dict.fromkeys(rows):
            if h is first:
                continue
            fd, fn, kn = h.field_dtype, h.field_ndim, h.known
            for n, dn, nd, _ in layout:
                if n not in kn or fd[n] != dn or fn.get(n) != nd:
                    break
            else:
                continue
            news.append((h, [NewField(n, dn, nd) for n, dn, nd, shape in layout if h.check_field(n, dn, shape)]))
        for h, new in news:
            h.register_fields(new, self._queue.cond)
        return self._queue.put_record(Record(first, steps, calls, checked, nbytes, rows), self._thread.is_alive)

    def make_room(self, handle_id: str, nbytes: int) -> bool:
        """Make room for a block of ``nbytes`` before building it: a recorder calls this before
        it copies a record bigger than its open-block share, so it never holds one such record
        in a new block while the writer still holds the previous one (SPEC §8).

        Returns:
            True when a block of ``nbytes`` would now be queued without waiting (policy
            ``"block"`` waits for that); False when policy ``"drop"`` would drop it: one record
            of ``handle_id`` is then counted as dropped.

        Raises:
            Same as :meth:`write`.
        """
        h = self._open_handle(handle_id)
        return self._queue.make_room(h, int(nbytes), self._thread.is_alive)

    def _block_steps(self, handle_id: str, steps: Any, calls: Any) -> tuple[list[int], list[int]]:
        """A block's steps and calls as checked lists of ints (copies)."""
        if type(steps) is list and type(calls) is list and len(steps) == len(calls) and steps:
            # The recorder's case, checked in Python: numpy's checks of a few ints cost ~50 us.
            if all(type(v) is int for v in steps) and all(type(v) is int for v in calls):
                check_steps(handle_id, steps, calls)
                return steps[:], calls[:]  # copies: the caller keeps its lists
        st = np.asarray(steps)
        ca = np.asarray(calls)
        if st.size == 0 and ca.size == 0:
            raise InvalidArgumentError(f"write_block({handle_id!r}): empty block (no steps); write at least one record")
        if st.ndim != 1 or ca.shape != st.shape or st.dtype.kind not in "iu" or ca.dtype.kind not in "iu":
            raise InvalidArgumentError(
                f"write_block({handle_id!r}): steps and calls must be 1-D integer sequences of the same "
                f"length, got steps {st.dtype} {st.shape} and calls {ca.dtype} {ca.shape}")
        out_steps, out_calls = st.tolist(), ca.tolist()
        check_steps(handle_id, out_steps, out_calls)
        return out_steps, out_calls

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
        new = []
        for name, (dn, shape) in fields.items():
            dtypes.info(dn)
            if h.check_field(name, dn, tuple(shape)):
                new.append(NewField(name, dn, len(shape)))
        h.register_fields(new, self._queue.cond)

    def _open_handle(self, handle_id: str) -> WriterHandle:
        """The declared handle ``handle_id`` of an open writer that has not failed."""
        if self._closed or self._queue.closing:
            raise WriterClosedError(f"RunWriter for {str(self.run_dir)!r} is closed; create a new writer")
        if self._queue.error is not None:
            raise self._queue.error
        h = self._handles.get(handle_id)
        if h is None:
            raise UnknownNameError(
                f"unknown handle {handle_id!r}: call add_handle() first (known: {sorted(self._handles)[:20]})")
        return h

    def _put(self, h: WriterHandle, steps: list[int], calls: list[int], fields: Mapping[str, FieldValue],
             k: int | None) -> bool:
        """Check ``fields`` (one record if ``k`` is None, else a block of ``k``) and queue them."""
        checked, new, nbytes = checked_fields(h, fields, k)
        h.register_fields(new, self._queue.cond)
        return self._queue.put_record(Record(h, steps, calls, checked, nbytes), self._thread.is_alive)

    # --- control ----------------------------------------------------------------------------------
    def on_own_thread(self) -> bool:
        """Whether the calling thread is one of the writer's own (which must not wait for it)."""
        return self._thread.owns(threading.current_thread())

    def _check_open(self) -> None:
        if self._closed or self._queue.closing:
            raise WriterClosedError(f"RunWriter for {str(self.run_dir)!r} is closed; create a new writer")

    def raise_if_failed(self) -> None:
        """Raise the background :class:`StorageError` if the writer failed (cheap, no I/O)."""
        if self._queue.error is not None:
            raise self._queue.error

    def flush(self) -> None:
        """Block until every record written so far is on disk, fsynced, and readable after a crash.

        Raises:
            WriterClosedError: after :meth:`close`.
            StorageError: a background write failed (records flushed before stay readable).
        """
        self._check_open()
        if self._queue.error is not None:
            raise self._queue.error
        self._queue.submit_and_wait(Flush(), self._thread.is_alive)

    def stats(self) -> WriterStats:
        """A snapshot of the counters."""
        with self._queue.cond:
            err = self._queue.error
            return WriterStats(
                handles={k: HandleStats(**vars(v)) for k, v in self._stats.handles.items()},
                peak_buffer_bytes=self._stats.peak_buffer_bytes,
                max_buffer_bytes=self.max_buffer_bytes,
                blocked_seconds=self._stats.blocked_seconds,
                parked_files=self._stats.parked_files,
                index_seals=self._stats.index_seals,
                error=str(err) if err else None,
            )

    def close(self) -> WriterStats:
        """Flush, merge each handle's segments into ``<key>.h5``, write the manifest; idempotent.

        Returns:
            The final :class:`WriterStats`.

        Raises:
            StorageError: if the background thread failed (raised by the first ``close`` only;
                everything flushed before the failure stays readable).
        """
        with self._queue.cond:
            first = not (self._closed or self._queue.closing)
            self._queue.closing = True
        if first:
            atexit.unregister(self._atexit)
            try:
                self._queue.submit_and_wait(Close(), self._thread.is_alive)
            except StorageError:
                pass
            finally:
                self._thread.join(timeout=60)
                self._closed = True
                self._close_stats = self.stats()
                unlock_run(self.run_dir, self._suffix, self._lock_fd)  # a clean close leaves no lock file
        else:
            while not self._closed:
                time.sleep(0.01)
        err = self._queue.error
        if err is not None and not self._error_raised_by_close:
            self._error_raised_by_close = True
            raise err
        return self._close_stats or self.stats()

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_ranks(rank: Any, world_size: Any) -> None:
    """Raise InvalidArgumentError unless ``world_size`` is a positive int or None and ``rank`` an
    int in ``[0, world_size)`` or None."""
    if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
        raise InvalidArgumentError(f"world_size must be a positive int or None, got {world_size!r}")
    if rank is not None and (not isinstance(rank, int) or rank < 0 or (world_size and rank >= world_size)):
        raise InvalidArgumentError(f"rank must be an int in [0, world_size), got {rank!r}")
