"""Gathering dataset rows straight out of the page cache: the fast path of
:func:`~.dataset_read.iter_blocks` for fields stored as plain chunks.

A fixed-shape field whose chunks hold whole records and are stored without filters (no
compression: hookline's default) has every row at a known byte offset of its file. Its files are
memory-mapped read-only and a batch's rows are copied from the mapping into the batch buffer
(``np.take``, which releases the GIL): each byte is copied once, with no intermediate
window. Long runs of consecutive rows (reading in order) are read with ``os.preadv`` into the
batch buffer instead: the kernel's copy out of its page cache is faster than a copy through the
mapping. The chunks of a window are announced to the kernel first (``MADV_WILLNEED``), so rows
not yet in memory are read from disk in chunk-sized blocks, never one read per row.

Mappings (:class:`MapCache`) and batch buffers (:class:`BufferPool`) are kept between epochs:
the first touch of a page of a new mapping or buffer costs a page fault. A batch buffer is reused
only once nothing outside the pool refers to it (no tensor, view or array made from it is alive).
A kept mapping keeps its file's disk space allocated after the file is replaced or removed (a
live run's merge), until the dataset is gone or the mapping is evicted. Needs only numpy.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import threading
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from .. import dtypes
from ..reader import Field

__all__ = ["MappedRows", "MapCache", "OwnFd", "BufferPool", "map_fields", "FILE_SHIFT"]

#: A row reference is ``file << FILE_SHIFT | byte offset`` (files up to 16 TiB).
FILE_SHIFT = 44
_OFFSET = (1 << FILE_SHIFT) - 1


class OwnFd:
    """A descriptor of its own of an open file, closed when the last reference to it goes (a
    :class:`MappedRows` keeps the ones it reads from, whatever the cache evicts)."""

    def __init__(self, fd: int) -> None:
        self.fd = os.dup(fd)

    def __del__(self) -> None:
        os.close(self.fd)


class MapCache:
    """Read-only mappings of whole files by identity (device, inode, size, mtime), each with a
    descriptor of the file (for :func:`os.preadv` of long runs), at most ``capacity`` kept;
    thread-safe."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._maps: OrderedDict[tuple[int, int, int, int], tuple[mmap.mmap, OwnFd]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, fd: int) -> tuple[mmap.mmap, OwnFd]:
        """The mapping of the file open as ``fd`` and a descriptor of it (made on first use)."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            got = self._maps.get(key)
            if got is None:
                got = self._maps[key] = (mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ), OwnFd(fd))
                while len(self._maps) > self.capacity:
                    self._maps.popitem(last=False)  # (both go with their last user)
            self._maps.move_to_end(key)
            return got


class MappedRows:
    """One field's rows as references into mapped files.

    Args:
        maps: the mapped files (index = the file part of a reference) and their descriptors.
        entry_refs: reference of every entry (record) of the field: its first byte.
        chunks: ``(file, offset, nbytes)`` of the chunk every entry lies in.
        row_bytes: bytes of one row (a record's rows lie one after another).
    """

    def __init__(self, maps: list[tuple[mmap.mmap, OwnFd]], entry_refs: np.ndarray, chunks: np.ndarray,
                 row_bytes: int) -> None:
        self.maps = [m for m, _ in maps]
        self.files = [f for _, f in maps]
        self.entry_refs = entry_refs
        self.chunks = chunks
        self.row_bytes = row_bytes

    def refs(self, entries: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """References of the rows of ``entries`` (``counts`` rows each), in order."""
        starts = np.cumsum(counts) - counts
        within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)
        return np.repeat(self.entry_refs[entries], counts) + within * self.row_bytes

    def will_need(self, entries: np.ndarray) -> None:
        """Ask the kernel to read the chunks of ``entries`` ahead (whole chunks, asynchronously)."""
        if not hasattr(mmap, "MADV_WILLNEED"):
            return
        page = mmap.PAGESIZE
        for f, off, n in np.unique(self.chunks[entries], axis=0):
            start = int(off) - int(off) % page
            self.maps[int(f)].madvise(mmap.MADV_WILLNEED, start, int(off) + int(n) - start)

    def gather(self, refs: np.ndarray, out: np.ndarray) -> None:
        """Copy the rows ``refs`` into ``out`` (C-contiguous, ``len(refs)`` rows of this field).

        Rows are gathered with ``np.take(..., out=, mode="clip")`` (``mode="raise"`` would copy
        through a scratch buffer; the refs are in range by construction) from a 2-D view of a mapping whose rows
        start at the refs' offset modulo the row size: one ``take`` per run of consecutive refs
        in the same (file, phase) (rows in storage order make few runs); with many short runs,
        one ``take`` per (file, phase) through a scratch array.
        """
        rb, n = self.row_bytes, len(refs)
        if not n:
            return
        dst = out.reshape(n, -1).view(np.uint8)
        files, offsets = refs >> FILE_SHIFT, refs & _OFFSET
        runs = np.flatnonzero(np.diff(refs) != rb) + 1
        if len(runs) < n // 16:  # (long runs of consecutive rows: the kernel copies them faster)
            for a, b in zip(np.concatenate([[0], runs]), np.concatenate([runs, [n]])):
                _pread(self.files[int(files[a])].fd, memoryview(dst[a:b]).cast("B"), int(offsets[a]))
            return
        group = files * rb + offsets % rb
        cuts = np.flatnonzero(group[1:] != group[:-1]) + 1
        if len(cuts) <= max(8, n // 64):
            for a, b in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [n]])):
                np.take(self._rows(int(group[a])), offsets[a:b] // rb, axis=0, out=dst[a:b], mode="clip")
            return
        for g in np.unique(group):
            m = group == g
            dst[m] = np.take(self._rows(int(g)), offsets[m] // rb, axis=0)

    def _rows(self, group: int) -> np.ndarray:
        """The mapping of file ``group // row_bytes`` as rows that start at ``group % row_bytes``
        (row ``offset // row_bytes`` of it starts at byte ``offset``)."""
        rb = self.row_bytes
        m, phase = self.maps[group // rb], group % rb
        return np.frombuffer(m, np.uint8, count=(len(m) - phase) // rb * rb, offset=phase).reshape(-1, rb)


def _pread(fd: int, buf: memoryview, offset: int) -> None:
    """Fill ``buf`` with the file's bytes from ``offset`` on (``os.preadv`` releases the GIL)."""
    done = 0
    while done < len(buf):
        k = os.preadv(fd, [buf[done:]], offset + done)
        if k <= 0:
            raise OSError(f"file ended at byte {offset + done} while reading rows that the file's chunk index places "
                          f"before its end")
        done += k


def _chunk_table(ds: Any) -> dict[int, tuple[int, int, int]]:
    """Chunk row -> (byte offset, stored bytes, filter mask) of an h5py dataset's allocated chunks."""
    table: dict[int, tuple[int, int, int]] = {}
    step = ds.chunks[0]

    def visit(info: Any) -> None:
        table[info.chunk_offset[0] // step] = (info.byte_offset, info.size, info.filter_mask)

    try:
        ds.id.chunk_iter(visit)
    except (AttributeError, NotImplementedError):  # (HDF5 < 1.12.3: one call per chunk)
        for i in range(ds.id.get_num_chunks()):
            visit(ds.id.get_chunk_info(i))
    return table


def _piece(pf: Any, row_bytes: int, storage: np.dtype, cache: MapCache
           ) -> tuple[tuple[mmap.mmap, OwnFd], np.ndarray, np.ndarray] | None:
    """((mapping, descriptor), first-byte offset of every entry, ``(offset, nbytes)`` of its chunk) of one
    file's part of a field, or None when its rows cannot be read from a mapping."""
    shape = pf.shape
    ds = pf.ds
    if (shape is None or ds.chunks is None or tuple(ds.chunks[1:]) != tuple(shape) or ds.dtype != storage
            or ds.id.get_create_plist().get_nfilters() != 0):
        return None
    rec_bytes = math.prod(shape) * storage.itemsize
    if rec_bytes % row_bytes:
        return None
    per = ds.chunks[0]
    n = int(pf.count)
    need = -(-n // per)
    table = _chunk_table(ds)
    if any(table.get(c, (0, 0, 1))[1:] != (per * rec_bytes, 0) for c in range(need)):
        return None  # (a chunk missing, filtered or of another size)
    try:
        fd = pf.part.fid.get_vfd_handle()
    except Exception:  # (a driver without a descriptor)
        return None
    m, own = cache.get(fd)
    chunk_off = np.array([table[c][0] for c in range(need)], np.int64)
    if need and int(chunk_off.max()) + per * rec_bytes > len(m):
        return None
    e = np.arange(n, dtype=np.int64)
    chunks = np.stack([chunk_off[e // per], np.full(n, per * rec_bytes, np.int64)], axis=1)
    return (m, own), chunk_off[e // per] + (e % per) * rec_bytes, chunks


def map_fields(fields: list[Field], row_shapes: list[tuple[int, ...] | None], cache: MapCache
               ) -> list[MappedRows] | None:
    """The fields' rows as :class:`MappedRows` (``row_shapes``: the plan's), or None when any
    of them is not stored as plain, unfiltered chunks of whole records in local files (or the
    system has no POSIX ``mmap``)."""
    if not hasattr(mmap, "MAP_SHARED"):
        return None
    out = []
    for fld, shape in zip(fields, row_shapes):
        if shape is None or fld.shape is None:
            return None
        storage = np.dtype(dtypes.info(fld.dtype_name).storage)
        row_bytes = math.prod(shape) * storage.itemsize
        if row_bytes == 0:
            return None
        maps, refs, chunks = [], [], []
        for pf in fld.pieces:
            got = _piece(pf, row_bytes, storage, cache)
            if got is None:
                return None
            i = len(maps)
            maps.append(got[0])
            refs.append(got[1] | (i << FILE_SHIFT))
            chunks.append(np.concatenate([np.full((len(got[1]), 1), i, np.int64), got[2]], axis=1))
        if not maps:
            return None
        out.append(MappedRows(maps, np.concatenate(refs), np.concatenate(chunks), row_bytes))
    return out


class BufferPool:
    """Blocks (dicts key -> array) made by ``make`` and handed out again once nothing outside
    the pool refers to any of their arrays (at most ``capacity`` kept); thread-safe."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.made = 0  # statistics (tests)
        self._blocks: list[list[Any]] = []  # [block, references while free]
        self._lock = threading.Lock()

    @staticmethod
    def _refs(block: dict[str, np.ndarray]) -> int:
        """References to the block (the queue, a consumer) and to its arrays (tensors, views)."""
        return sys.getrefcount(block) + sum(sys.getrefcount(a) for a in block.values())

    def take(self, make: Callable[[], dict[str, np.ndarray]], fits: Callable[[dict[str, np.ndarray]], bool]
             ) -> dict[str, np.ndarray]:
        """A free pooled block that ``fits``, else a new one from ``make`` (pooled while there is room)."""
        with self._lock:
            for entry in self._blocks:
                block = entry[0]
                if self._refs(block) == entry[1] and fits(block):
                    return block
            block = make()
            self.made += 1
            if len(self._blocks) < self.capacity:
                entry = [block, 0]
                self._blocks.append(entry)
                entry[1] = self._refs(block)  # (counted as in the loop above: the entry and `block`)
            return block
