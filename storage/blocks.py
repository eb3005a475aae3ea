"""Bounded reads of a run's records for ``show``, ``export`` and ``compare``.

A :class:`~hookline.storage.reader.Field` is read in blocks of consecutive records of at most
``block_bytes`` (counted as float64), so memory stays bounded however large the run is;
:func:`damage_note` says when a handle has damaged files or fewer readable records than its
manifest lists.
Needs only numpy (never imports torch).
"""

from __future__ import annotations

import warnings
from typing import Iterator, Sequence

import numpy as np

from .reader import DAMAGE_WARNING, Field, Handle

__all__ = ["BLOCK_BYTES", "records_per_block", "contiguous_runs", "read_block", "iter_records",
           "readable_records", "damage_note"]

#: Default read block: at most this many bytes of float64 per block.
BLOCK_BYTES = 16 << 20


def records_per_block(shape: tuple[int, ...], block_bytes: int) -> int:
    """How many records of ``shape`` fit in ``block_bytes`` of float64 (at least one)."""
    return max(1, block_bytes // max(1, 8 * int(np.prod(shape))))


def contiguous_runs(ia: np.ndarray, ib: np.ndarray | None, max_n: int) -> Iterator[tuple[int, int]]:
    """Split positions ``0..len(ia)`` into ``[s, e)`` runs of at most ``max_n`` where ``ia`` (and
    ``ib``) step by one: each run is one block read (of each field)."""
    n = len(ia)
    if n == 0:
        return
    brk = np.diff(ia) != 1
    if ib is not None:
        brk |= np.diff(ib) != 1
    starts = np.concatenate([[0], np.nonzero(brk)[0] + 1, [n]])
    for s, e in zip(starts[:-1], starts[1:]):
        s, e = int(s), int(e)
        while s < e:
            yield s, min(e, s + max_n)
            s += max_n


def read_block(fld: Field, lo: int, hi: int) -> np.ndarray:
    """Records ``lo:hi`` of a fixed-shape field, stacked on a new axis 0."""
    if hi - lo == 1:
        return np.asarray(fld[lo])[None]
    return np.asarray(fld[lo:hi])


def iter_records(
    fld: Field, indices: Sequence[int] | np.ndarray | None = None, *, block_bytes: int = BLOCK_BYTES
) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(position, record)`` for the given record indices of a field (all by default),
    reading blocks of consecutive records of at most ``block_bytes`` at a time (a ragged field:
    one record at a time)."""
    idx = np.arange(len(fld)) if indices is None else np.asarray(indices, np.int64)
    if fld.shape is None:
        for pos, i in enumerate(idx):
            yield pos, np.asarray(fld[int(i)])
        return
    for s, e in contiguous_runs(idx, None, records_per_block(fld.shape, block_bytes)):
        block = read_block(fld, int(idx[s]), int(idx[e - 1]) + 1)
        for k in range(e - s):
            yield s + k, np.asarray(block[k])


def readable_records(handle: Handle) -> tuple[int, int | None]:
    """``(readable, expected)`` records of a handle; ``expected`` comes from the manifest
    (``None`` when unknown). ``readable < expected`` means files are damaged or missing."""
    expected = handle.manifest.get("records")
    return len(handle), (int(expected) if isinstance(expected, (int, np.integer)) else None)


def damage_note(handle: Handle, which: str = "") -> str | None:
    """A one-line note when a handle has damaged files (its :attr:`~.reader.Handle.problems`) or
    fewer readable records than its manifest lists; None when neither. The caller shows the note:
    if this call opens the handle's files, the reader's own warning about them is not shown.

    Args:
        handle: the handle.
        which: the run's label in the note (``"A"``), or empty.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=DAMAGE_WARNING)
        readable, expected = readable_records(handle)
        problems = handle.problems
    short = expected is not None and readable < expected
    if not short and not problems:
        return None
    where = f" in run {which}" if which else ""
    count = f"only {readable} of the {expected}" if short else f"{readable}"
    if problems:
        why = f"{len(problems)} damaged file{'s' if len(problems) > 1 else ''} skipped: {problems[0]}"
        why += f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    else:
        why = "damaged or missing file"
    return (f"{count} records of {handle.id!r}{where} are readable ({why}; run `hookline verify` on the "
            f"run directory)")
