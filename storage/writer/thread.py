"""The writer's background thread: takes batches off the queue, stages and seals parts, flushes, closes.

One thread does all HDF5 writing of a RunWriter (h5py releases the GIL inside HDF5 calls, so
the training thread keeps running); a second one compacts sealed parts (:mod:`.merging`). A
failure of either is recorded once (:meth:`WriteQueue.fail`); from then on records are
discarded and every ``flush()``/``close()`` is answered with the error.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from .._fs import fsync_dir
from .._parts import discover_files
from ..budget import Budget
from ..priority import lower_this_thread
from .context import WriterContext
from .failure import background_error
from .handle import WriterHandle
from .manifest import ManifestWriter
from .merging import Compactor, finalize
from .queue import Close, Control, Flush, Message, NewHandle, Record, WriteQueue
from .open_parts import OpenParts
from .staging import take_shared_rows
from .stats import WriterStats

__all__ = ["WriterThread"]


class WriterThread:
    """The background side of a RunWriter.

    Args:
        ctx: the writer's shared state.
        queue: where the callers' messages arrive.
        handles: the writer's handles (declaration order; added to by callers).
        stats: the writer's counters.
        budget: the writer's memory budget.
        manifest: builds and writes the manifest.
        autoflush_s: seal open parts when this many seconds passed since the last flush (None:
            never).
        merge_on_close: merge each handle's parts into ``<key>.h5`` at close.
    """

    def __init__(self, ctx: WriterContext, queue: WriteQueue, handles: dict[str, WriterHandle],
                 stats: WriterStats, budget: Budget, manifest: ManifestWriter, *,
                 autoflush_s: float | None, merge_on_close: bool) -> None:
        self.ctx = ctx
        self.queue = queue
        self._handles = handles
        self.budget = budget
        self.manifest = manifest
        self.autoflush_s = autoflush_s
        self.merge_on_close = merge_on_close
        self.parts = OpenParts(ctx, stats)
        self.stats = stats
        self.compactor = Compactor(ctx, self.handles)
        self._last_flush = time.monotonic()
        self.thread = threading.Thread(target=self._run, name=f"hookline-writer[{ctx.run_dir.name}]", daemon=True)

    def start(self) -> None:
        """Start the writer thread and the compactor."""
        self.thread.start()
        self.compactor.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the writer thread to end (after :class:`Close`)."""
        self.thread.join(timeout)

    def is_alive(self) -> bool:
        """Whether the writer thread runs."""
        return self.thread.is_alive()

    def owns(self, t: threading.Thread) -> bool:
        """Whether ``t`` is the writer thread or the compactor."""
        return t in (self.thread, self.compactor.thread)

    def handles(self) -> list[WriterHandle]:
        """A snapshot of the handles (callers add to them concurrently)."""
        return list(self._handles.values())

    # --- the loop ---------------------------------------------------------------------------------
    def _run(self) -> None:
        lower_this_thread(self.ctx.priority)  # (threads it starts inherit it)
        try:
            with np.errstate(all="ignore"):  # norms of inf/NaN data: no warnings (thread-local)
                self._loop()
        except BaseException as e:  # pragma: no cover - defensive: never leave callers hanging
            self._fail(e)
            self.queue.abandon()

    def _loop(self) -> None:
        while True:
            flush_at = None if self.autoflush_s is None else self._last_flush + self.autoflush_s
            batch = self.queue.take(flush_at, self.parts.has_staged)
            while batch:
                # popleft: a processed record's arrays must not stay referenced by the batch
                # after their bytes were released from the budget (else memory doubles).
                if self._process(batch.popleft()):
                    return
            if self.queue.error is None:
                self._after_batch()

    def _process(self, msg: Message) -> bool:
        """Handle one message; returns True for :class:`Close` (the thread ends)."""
        if self.queue.error is None:
            try:
                self._dispatch(msg)
            except BaseException as e:
                self._fail(e)
            else:
                if isinstance(msg, Control):
                    msg.answer()
                return isinstance(msg, Close)
        elif isinstance(msg, Record):
            self.queue.release(msg.nbytes)  # a failed writer discards records
        # The writer failed (now or before): flush and close get the error; close aborts.
        if isinstance(msg, Close):
            self._abort_all()
        if isinstance(msg, Control):
            msg.answer(self.queue.error)
        return isinstance(msg, Close)

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, Record):
            self._stage(msg)
            # (per record, not per batch: one batch can free hundreds of MB of blocks while the
            # copies grow the writer's own heap)
            self.queue.trimmer.maybe_trim()
        elif isinstance(msg, NewHandle):
            self._start_handle(msg.handle)
        elif isinstance(msg, Flush):
            self._flush_all()
        else:
            self._close_all()

    def _after_batch(self) -> None:
        """Between batches: the manifest when a handle started, the autoflush, memory relief."""
        try:
            if self.manifest.dirty:
                self._write_manifest("open")
            if self.autoflush_s is not None and time.monotonic() - self._last_flush >= self.autoflush_s:
                self._flush_all()
            elif self.ctx.tools.index > self.budget.index_bytes:
                self.stats.index_seals += 1
                self._flush_all()  # (index entries at their share of the budget: seal them)
            self.parts.relieve_memory(self.budget, self.queue.has_waiters())
        except BaseException as e:
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        self.queue.fail(background_error(e, self.ctx.tools.current, self.ctx.run_dir))

    # --- messages ---------------------------------------------------------------------------------
    def _start_handle(self, h: WriterHandle) -> None:
        """Find ``h``'s parts already on disk (a continued run) and record where to append."""
        h.started = True
        run_dir = self.ctx.run_dir
        found = discover_files(run_dir, h.key, h.suffix)
        for e in found.cover:
            path = run_dir / e.name
            if e.kind == "final":
                h.base.append(path)
            else:
                with self.ctx.sealed_lock:
                    h.sealed.append(replace(e, nbytes=path.stat().st_size))
        for e in found.superseded:
            # Inputs of a merge whose output was renamed into place before a crash: every record
            # is in a covering part, so they go now (close() promises one file per handle).
            if any(c.start <= e.start and e.end <= c.end for c in found.cover):
                (run_dir / e.name).unlink(missing_ok=True)
        for rel_name in found.leftovers:
            # Outputs of merges a crash interrupted: copies of records still in their inputs
            # (inputs are removed only after the output is published). This writer holds the run's
            # lock, so no merge is running on them.
            (run_dir / rel_name).unlink(missing_ok=True)
        h.next_record = found.end
        h.stats.flushed = h.stats.start = found.end
        self.manifest.dirty = True

    def _stage(self, msg: Record) -> None:
        """Stage a block of records in its handle's open part; a block of several handles'
        records is sorted into theirs (each handle's records copied out, in order: the block's
        memory goes as soon as it is sorted, not when the last handle fills a chunk)."""
        fields, msg.fields = msg.fields, {}
        if msg.rows is None:
            self._stage_one(msg.handle, msg.steps, msg.calls, fields, msg.nbytes)
            return
        groups: dict[WriterHandle, list[int]] = {}
        for i, h in enumerate(msg.rows):
            g = groups.get(h)
            if g is None:
                groups[h] = [i]
            else:
                g.append(i)
        if len(groups) == 1:
            self._stage_one(msg.handle, msg.steps, msg.calls, fields, msg.nbytes)
            return
        per = msg.nbytes // len(msg.rows)
        # Every row is copied out below: the block's memory is freed (or pooled) when this returns.
        self.queue.trimmer.note(msg.nbytes)
        steps, calls = msg.steps, msg.calls
        items = list(fields.items())
        arrs = [arr for _, (arr, _) in items]
        sig = tuple((name, dn, arr.dtype, arr.shape[1:]) for name, (arr, dn) in items)
        lean = take_shared_rows(groups, sig, arrs, steps, calls)
        for h, idx in groups.items():
            if h in lean:
                h.next_record += len(idx)
                h.written_bytes += per * len(idx)
                if len(idx) == 1:  # (note_steps, without a list per record)
                    s = steps[idx[0]]
                    if h.steps_min is None or s < h.steps_min:
                        h.steps_min = s
                    if h.steps_max is None or s > h.steps_max:
                        h.steps_max = s
                else:
                    h.note_steps([steps[i] for i in idx])
                continue
            sub = {name: (arr[idx], dn) for name, (arr, dn) in items}  # (copies)
            self._stage_one(h, [steps[i] for i in idx], [calls[i] for i in idx], sub, per * len(idx))

    def _stage_one(self, h: WriterHandle, steps: list[int], calls: list[int],
                   fields: dict[str, tuple[np.ndarray, str]], nbytes: int) -> None:
        """Stage records of one handle in its open part (sealing the part first when a field
        turned ragged: flush() will not see that part again, so it is sealed as a flush would)."""
        if h.note_shapes(fields):
            self.parts.seal(h, fsync=self.ctx.fsync)
        part = self.parts.part_for(h)
        h.next_record += len(steps)
        h.note_steps(steps)
        part.stage(steps, calls, fields, h.ragged, self.ctx.compression.for_field)
        h.written_bytes += nbytes

    def _flush_all(self) -> None:
        """Seal every open part, write the manifest, wake the compactor (and raise its error)."""
        self.parts.seal_all(self.handles(), self.ctx.fsync)
        self._write_manifest("open")
        self._last_flush = time.monotonic()
        self.compactor.wake()
        err = self.compactor.take_error()
        if err is not None:
            raise err

    def _close_all(self) -> None:
        """Seal every open part, stop the compactor, merge every handle's parts, write the final
        manifest: written once (a 1,000-handle manifest takes ~50 ms), the last flush's stands
        until then (it lists every handle; after a crash the files hold more records than it
        says, which readers and ``verify`` expect of an open run)."""
        self.parts.seal_all(self.handles(), self.ctx.fsync)
        if self.manifest.dirty:  # (a handle it does not list yet)
            self._write_manifest("open")
        self.compactor.stop()
        err = self.compactor.take_error()
        if err is not None:
            raise err
        if self.merge_on_close:
            dirs: set[Path] = set()  # renamed into: fsynced once each, before the manifest says closed
            for h in self.handles():
                finalize(self.ctx, h, dirs)
            if self.ctx.fsync:
                for d in dirs:
                    fsync_dir(d)
        self._write_manifest("closed")

    def _abort_all(self) -> None:
        """After a failure at close: drop the open parts, stop compaction, mark the run failed."""
        self.parts.abort()
        self.compactor.stop()
        try:
            self._write_manifest("failed")
        except Exception:
            pass

    def _write_manifest(self, status: str) -> None:
        self.ctx.tools.current = self.manifest.path
        err = self.queue.error
        self.manifest.write(status, self.handles(), str(err) if err else None)
        self.ctx.tools.current = None
