"""The writer thread's open parts: opened within ``max_open_files``, kept within the budget, sealed.

A part is sealed (written out, closed, renamed ``.h5seg.partial`` -> ``.h5seg``) at every flush,
when its handle's field turns ragged, and when more handles write than ``max_open_files`` allows
(the least recently written part goes first: a *rotation*, fsynced with the next flush).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Iterable

from .._fs import fsync_dir, fsync_file, publish
from .._h5write import HandleFileWriter
from .._parts import PartEntry
from ..budget import Budget
from ..format import partial_segment_name, segment_name
from .context import WriterContext
from .handle import WriterHandle
from .staging import OpenPart
from .stats import WriterStats

__all__ = ["OpenParts"]


class OpenParts:
    """The parts the writer thread has open, one per handle written since the last flush.

    Args:
        ctx: the writer's shared state.
        max_open_files: most parts open at once.
        stats: the writer's counters (``rotated_segments``).
    """

    def __init__(self, ctx: WriterContext, max_open_files: int, stats: WriterStats) -> None:
        self.ctx = ctx
        self.max_open_files = max_open_files
        self._stats = stats
        #: Handles with an open part, least recently written first.
        self.lru: OrderedDict[str, WriterHandle] = OrderedDict()
        #: Parts sealed by rotation and not fsynced yet (the next flush does).
        self.unsynced: list[Path] = []

    # --- open parts -------------------------------------------------------------------------------
    def part_for(self, h: WriterHandle) -> OpenPart:
        """``h``'s open part, opened now if it has none (sealing the least recently written part
        first when ``max_open_files`` are open)."""
        if h.part is not None:
            self.lru.move_to_end(h.id)
            return h.part
        while len(self.lru) >= self.max_open_files:
            self._rotate(next(iter(self.lru.values())))
        path = self.ctx.run_dir / partial_segment_name(h.key, h.suffix, h.next_record)
        self.ctx.tools.current = path
        path.parent.mkdir(parents=True, exist_ok=True)
        file = HandleFileWriter(path, self.ctx.identity.file_attrs(h), h.next_record, self.ctx.writeback)
        h.part = OpenPart(h.next_record, path, file, self.ctx.tools)
        self.lru[h.id] = h
        return h.part

    def has_staged(self) -> bool:
        """Whether any open part holds staged bytes."""
        return any(h.part.staged_bytes() for h in self.lru.values())

    def relieve_memory(self, budget: Budget, waiting: bool) -> None:
        """Write partial chunks when staged data would starve the budget (above
        :attr:`Budget.staged_high`, down to :attr:`Budget.staged_low`) or a caller waits for room."""
        staged = [(sf.staged_bytes, h.part, sf) for h in self.lru.values()
                  for sf in h.part.fields.values() if sf.staged_bytes]
        total = sum(s[0] for s in staged)
        if not waiting and total <= budget.staged_high:
            return
        staged.sort(key=lambda s: -s[0])
        for nb, part, sf in staged:
            if total <= budget.staged_low and not waiting:
                break
            part.write_out(sf, full_only=False)
            total -= nb

    # --- sealing ----------------------------------------------------------------------------------
    def seal(self, h: WriterHandle, fsync: bool) -> None:
        """Write everything staged of ``h``'s open part, close it and publish it as ``.h5seg``."""
        part = self._finish(h)
        if part is not None:
            self._publish([(h, part)], fsync)

    def seal_all(self, handles: Iterable[WriterHandle], fsync: bool) -> None:
        """Seal every open part (a flush); with ``fsync``, also the rotated parts not synced yet.
        Parts finished before a failure are still published."""
        if fsync and self.unsynced:
            self._sync_rotated()
        done: list[tuple[WriterHandle, OpenPart]] = []
        try:
            for h in handles:
                part = self._finish(h)
                if part is not None:
                    done.append((h, part))
        finally:
            if done:
                self._publish(done, fsync)

    def abort(self) -> None:
        """Close every open part without finishing it (after a failure)."""
        handles = list(self.lru.values())
        self.lru.clear()
        for h in handles:
            h.part.abort()
            h.part = None

    def _rotate(self, h: WriterHandle) -> None:
        """Seal ``h``'s open part to free its file (max_open_files). Not fsynced now (that would
        cost an fsync per rotation): :meth:`seal_all` fsyncs it with the next flush."""
        part = self._finish(h)
        if part is not None:
            final = self._publish([(h, part)], fsync=False)[0]
            if self.ctx.fsync:  # (without fsync nothing is synced: keeping the paths would only grow)
                self.unsynced.append(final)
            self._stats.rotated_segments += 1

    def _finish(self, h: WriterHandle) -> OpenPart | None:
        """Finish ``h``'s open part (closed, still ``.partial``) and forget it; None if it has none."""
        part = h.part
        if part is None:
            return None
        part.finish()
        h.part = None
        self.lru.pop(h.id, None)
        self.ctx.tools.current = None
        return part

    def _publish(self, done: list[tuple[WriterHandle, OpenPart]], fsync: bool) -> list[Path]:
        """Publish finished parts as ``.h5seg`` files and add them to their handles' sealed parts;
        returns their paths."""
        ctx = self.ctx
        entries = [PartEntry(segment_name(h.key, h.suffix, p.start, p.end), "segment", p.start, p.end)
                   for h, p in done]
        finals = [ctx.run_dir / e.name for e in entries]
        ctx.tools.current = done[0][1].partial
        publish([(p.partial, final) for (_, p), final in zip(done, finals)], fsync)
        for (h, _), e, final in zip(done, entries, finals):
            with ctx.sealed_lock:
                h.sealed.append(replace(e, nbytes=final.stat().st_size))
            h.stats.flushed = e.end
        ctx.tools.current = None
        return finals

    def _sync_rotated(self) -> None:
        """fsync the parts sealed by :meth:`_rotate` since the last flush (and their folders)."""
        paths, self.unsynced = self.unsynced, []
        for path in paths:
            self.ctx.tools.current = path
            try:
                fsync_file(path)
            except FileNotFoundError:
                pass  # merged away by the compactor since: its output was fsynced
        for d in {p.parent for p in paths}:
            fsync_dir(d)
        self.ctx.tools.current = None
