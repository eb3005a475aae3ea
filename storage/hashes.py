"""hookline's own chunk hashes: an xxh3-64 hash of every block of a field's entries, stored beside
the field's index (docs/format.md, "Chunk hashes").

A *block* is ``rows`` consecutive entries along axis 0 of the field's dataset (``rows`` is the
chunk's first dimension: one chunk of a fixed field, one chunk of a ragged field's flat data,
one record of a field whose records are split over several chunks). Its hash is XXH3-64 (seed
0) of the block's entries as stored: C order, the storage dtype, little-endian; the last block
holds what is left. The hashes are the dataset ``/_index/<field>/xxh3`` (uint64, one per block)
with the int64 attribute ``rows``.

The writer hashes each block from the memory it hands to HDF5, on its own thread (never the
training thread), while keeping its direct chunk writes: the bytes are not read back. Files
without hashes (written before hookline had them, or with ``checksums=False``) read and verify
as before.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from ._h5check import damaged

__all__ = ["HASH_DATASET", "ChunkHasher", "hash_rows", "block_failures", "check_entries"]

#: Name of the hash dataset in a field's index group.
HASH_DATASET = "xxh3"


class ChunkHasher:
    """Hashes a field's entries block by block as they are appended (in order).

    Args:
        row_bytes: bytes of one entry along axis 0 (a fixed record; one element of a ragged field).
        rows: entries per block.
    """

    __slots__ = ("rows", "block_bytes", "_h", "_filled", "digests")

    def __init__(self, row_bytes: int, rows: int) -> None:
        import xxhash  # (writers need it; a reader of files without hashes does not)

        self.rows = int(rows)
        self.block_bytes = max(1, int(row_bytes) * self.rows)
        self._h = xxhash.xxh3_64()
        self._filled = 0
        self.digests = array("Q")

    def update(self, data: np.ndarray) -> None:
        """Hash the next entries (any shape; C-contiguous data is hashed without a copy)."""
        mv = memoryview(np.ascontiguousarray(data)).cast("B")
        pos, n = 0, len(mv)
        while pos < n:
            take = min(n - pos, self.block_bytes - self._filled)
            self._h.update(mv[pos : pos + take])
            pos += take
            self._filled += take
            if self._filled == self.block_bytes:
                self.digests.append(self._h.intdigest())
                self._h.reset()
                self._filled = 0

    def finish(self) -> np.ndarray:
        """The hash of every block (the last one partial), as uint64."""
        if self._filled:
            self.digests.append(self._h.intdigest())
            self._h.reset()
            self._filled = 0
        return np.frombuffer(self.digests, dtype=np.uint64).copy() if self.digests else np.zeros(0, np.uint64)


def hash_rows(data: np.ndarray) -> int:
    """XXH3-64 of ``data``'s bytes in C order (one block)."""
    import xxhash

    return xxhash.xxh3_64_intdigest(memoryview(np.ascontiguousarray(data)).cast("B"))


def _stored(pf: Any) -> tuple[np.ndarray, int] | None:
    """A part field's stored hashes and block rows, or None when the file has none."""
    g = pf.part.f.get(f"_index/{pf.name}")
    ds = None if g is None else g.get(HASH_DATASET)
    if ds is None:
        return None
    rows = ds.attrs.get("rows")
    if rows is None or int(rows) < 1:
        return np.zeros(0, np.uint64), 0
    return ds[()].astype(np.uint64), int(rows)


def _extent(pf: Any) -> int:
    """Entries along axis 0 that hold the field's data (records; a ragged field's elements)."""
    if pf.shape is not None:
        return pf.count
    if not pf.count:
        return 0
    sizes = np.prod(pf.shapes, axis=1) if pf.ndim else np.ones(pf.count, np.int64)
    return int(pf.offsets[-1] + sizes[-1])


def block_failures(pf: Any, blocks: range | None = None, read_bytes: int = 16 << 20) -> list[tuple[int, int]] | None:
    """The item ranges (along axis 0) of the blocks whose data no longer has its stored hash.

    Args:
        pf: a :class:`~._h5read.PartField`.
        blocks: the blocks to check (default: all).
        read_bytes: about how many bytes to read at once.

    Returns:
        ``[(first item, end item), ...]`` of failing blocks (a missing hash or a block count
        that does not fit the data counts as failing); None when the file stores no hashes.
    """
    got = _stored(pf)
    if got is None:
        return None
    hashes, rows = got
    extent = _extent(pf)
    want = -(-extent // rows) if rows else -1
    if want != len(hashes):
        return [(0, extent)]
    ds = pf.ds
    row_bytes = max(1, ds.dtype.itemsize * int(np.prod(ds.shape[1:])))
    per_read = max(1, read_bytes // (row_bytes * rows))
    todo = blocks if blocks is not None else range(want)
    bad: list[tuple[int, int]] = []
    for i in range(todo.start, todo.stop, per_read):
        j = min(todo.stop, i + per_read)
        data = ds[i * rows : min(extent, j * rows)]
        for k in range(i, j):
            a = (k - i) * rows
            if hash_rows(data[a : a + rows]) != int(hashes[k]):
                bad.append((k * rows, min(extent, (k + 1) * rows)))
    return bad


def check_entries(pf: Any, a: int, b: int, done: set[int] | None = None) -> None:
    """Check the hashes of the blocks holding a fixed field's entries ``[a, b)`` (or a ragged
    field's elements ``[a, b)``); nothing when the file has none. ``done``: blocks checked
    already (skipped; the ones checked now are added).

    Raises:
        FormatError: a block's data does not have its stored hash (the message names the file,
            the field and the entries).
    """
    got = _stored(pf)
    if got is None or b <= a:
        return
    rows = got[1] or 1
    first, end = a // rows, -(-b // rows)
    if done is not None:
        while first < end and first in done:
            first += 1
        while end > first and end - 1 in done:
            end -= 1
        if first >= end:
            return
    bad = block_failures(pf, range(first, end))
    if done is not None and not bad:
        done.update(range(first, end))
    if bad:
        x, y = bad[0]
        raise damaged(str(pf.part.path), f"field {pf.name!r}: items {x}-{y - 1} fail their xxh3 chunk hash "
                                         f"(data damaged on disk)")
