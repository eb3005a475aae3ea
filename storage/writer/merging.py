"""Merging a handle's sealed parts: compaction on its own thread while the run goes on, and the
handle's final ``<key>.h5`` at close.

Compaction only touches sealed, immutable parts: it merges runs of them into one (written as a
``.partial`` merge output, published, then its inputs removed), so a long run does not leave
thousands of files, and a crash at any point leaves each record in some complete part.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable

from .._fs import fsync_dir, make_folder, publish
from .._h5check import Structure, forget, remember
from .._h5write import HandleFileWriter
from .._merge import merge_files
from .._parts import PartEntry
from ..format import final_name, merge_output_name, segment_name
from ..priority import lower_this_thread
from .context import WriterContext
from .handle import WriterHandle

__all__ = ["COMPACT_FANIN", "COMPACT_MIN_SEGMENTS", "Compactor", "finalize", "pick_merge"]

#: Merge this many similar-sized trailing segments into one (compaction fan-in).
COMPACT_FANIN = 8
#: No compaction while a handle has fewer sealed segments (each merge copies data; a few dozen
#: files are cheap, and close() merges everything once anyway).
COMPACT_MIN_SEGMENTS = 32


def pick_merge(sizes: list[int]) -> tuple[int, int] | None:
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


def _merge(ctx: WriterContext, h: WriterHandle, paths: list[Path], out: Path,
           record_start: int = 0) -> Structure | None:
    """Copy the records of ``h``'s complete parts ``paths`` (in order) into the new file ``out``,
    with at most ``MERGE_MAX_FILES`` inputs open at once; returns its structure."""
    return merge_files(paths, out, ctx.identity.file_attrs(h), ctx.compression.for_field,
                       record_start=record_start, writeback=ctx.writeback_bytes,
                       mid_path=lambda a, b: ctx.run_dir / merge_output_name(h.key, h.suffix, a, b)).structure


class Compactor:
    """The compaction thread: after each flush, merges runs of sealed segments of every handle.

    Args:
        ctx: the writer's shared state.
        handles: returns the writer's handles now.
    """

    def __init__(self, ctx: WriterContext, handles: Callable[[], list[WriterHandle]]) -> None:
        self.ctx = ctx
        self._handles = handles
        self._cond = threading.Condition()
        self._wanted = False
        self._stop = False
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="hookline-compactor", daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self.thread.start()

    def wake(self) -> None:
        """Look for runs to merge (after a flush sealed parts)."""
        with self._cond:
            self._wanted = True
            self._cond.notify_all()

    def stop(self) -> None:
        """Stop after the current merge and wait for the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self.thread.join()

    def take_error(self) -> BaseException | None:
        """The error that stopped compaction, if any (returned once)."""
        e, self._error = self._error, None
        return e

    def _loop(self) -> None:
        lower_this_thread(self.ctx.priority)
        while True:
            with self._cond:
                while not self._wanted and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                self._wanted = False
            try:
                for h in self._handles():
                    self._compact(h)
            except BaseException as e:
                self._error = e
                return

    def _compact(self, h: WriterHandle) -> None:
        """Merge runs of ``h``'s sealed segments while :func:`pick_merge` finds one."""
        while not self._stop:
            with self.ctx.sealed_lock:
                pick = pick_merge([s.nbytes for s in h.sealed])
                run = list(h.sealed[pick[0] : pick[1]]) if pick else None
            if not run:
                return
            self._merge_run(h, run)

    def _merge_run(self, h: WriterHandle, run: list[PartEntry]) -> None:
        """Merge consecutive sealed segments into one and put it in their place."""
        ctx = self.ctx
        start, end = run[0].start, run[-1].end
        name = segment_name(h.key, h.suffix, start, end)
        out = ctx.run_dir / name
        tmp = ctx.run_dir / merge_output_name(h.key, h.suffix, start, end)
        st = _merge(ctx, h, [ctx.run_dir / s.name for s in run], tmp, record_start=start)
        publish([(tmp, out)], ctx.fsync)
        for s in run:  # (first: their entries must not push out others when the output's comes in)
            forget(ctx.run_dir / s.name)
        remember(out, st)
        with ctx.sealed_lock:
            i = h.sealed.index(run[0])
            h.sealed[i : i + len(run)] = [PartEntry(name, "segment", start, end, out.stat().st_size)]
        for s in run:
            (ctx.run_dir / s.name).unlink(missing_ok=True)


def finalize(ctx: WriterContext, h: WriterHandle, dirs: set[Path] | None = None) -> None:
    """Merge a handle's complete parts into ``<key>.h5`` (a rename when there is one segment).

    Args:
        dirs: where to note the directory of a rename, to fsync once for all handles (the
            caller fsyncs them before it writes the manifest); None: fsync it now.
    """
    final = ctx.run_dir / final_name(h.key, h.suffix)
    ctx.tools.current = final
    segs = list(h.sealed)
    if not segs and h.base:
        return  # nothing new since the run was continued
    if not h.base and len(segs) == 1 and segs[0].start == 0:
        seg = ctx.run_dir / segs[0].name
        st = forget(seg)
        os.replace(seg, final)
        remember(final, st)  # (a rename changes the file's identity: the same structure)
        if dirs is not None:
            dirs.add(final.parent)
        elif ctx.fsync:
            fsync_dir(final.parent)
    else:
        tmp = final.with_name(final.name + ".partial")
        if not h.base and not segs:
            make_folder(ctx.run_dir, final.parent)
            empty = HandleFileWriter(tmp, ctx.identity.file_attrs(h), 0)
            empty.finish()
            st = empty.structure
        else:
            st = _merge(ctx, h, [*h.base, *(ctx.run_dir / s.name for s in segs)], tmp)
        for b in h.base:  # (the file the rename replaces)
            forget(b)
        publish([(tmp, final)], ctx.fsync)
        for s in segs:  # (first: their entries must not push out others when the output's comes in)
            forget(ctx.run_dir / s.name)
        remember(final, st)
        for s in segs:
            (ctx.run_dir / s.name).unlink(missing_ok=True)
    with ctx.sealed_lock:
        h.sealed = []
        h.base = [final]
    h.final_done = True
    ctx.tools.current = None
