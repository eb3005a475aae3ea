"""The part the writer thread is writing for one handle: records staged per field, written in whole chunks.

Records arrive in runs (a block of ``k`` records per queue message). A field's runs wait here
until they fill a chunk, then go to HDF5 in one call (or straight from the record's memory, for
records of one chunk each), so the training thread's GIL is handed over per chunk, not per record.
"""

from __future__ import annotations

import math
import weakref
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .._fs import make_folder
from .._h5check import Structure
from .._h5write import FieldOut, FieldSpec, HandleFileWriter
from .norms import l2, row_norms
from .stats import WriterStats

__all__ = ["FileSlots", "OpenPart", "PartTools", "Scratch", "StagedField", "take_shared_rows"]

#: Largest block assembled in memory for one write (bounds the scratch buffer).
PIECE_BYTES = 8 << 20
#: A field without a dataset yet (its chunk size is chosen for what is staged when it is
#: created) or with one record per chunk is written once this much is staged (or this many
#: fixed-shape records): fewer, larger HDF5 calls.
BATCH_BYTES = 1 << 20
BATCH_RECORDS = 1 << 16
#: Smallest first chunk (a small first flush must not leave the rest of the part with tiny chunks).
MIN_FIRST_CHUNK_BYTES = 64 << 10


class Scratch:
    """One reusable buffer for assembling several staged runs into a single write (writer thread)."""

    def __init__(self) -> None:
        self._buf = np.empty(0, np.uint8)

    def view(self, nbytes: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """The first ``nbytes`` of the buffer (grown as needed) as an array of ``dtype``, ``shape``."""
        if self._buf.nbytes < nbytes:
            self._buf = np.empty(max(nbytes, 2 * self._buf.nbytes), np.uint8)
        return self._buf[:nbytes].view(dtype).reshape(shape)


class FileSlots:
    """The parts whose HDF5 file is open, at most ``limit``: the least recently used is *parked*
    (its file closed, to be reopened when its part writes again) when one more must open.

    Parking seals nothing: the part stays one ``.partial`` segment, so any number of handles
    writes through a few open files without a segment per rotation (each open HDF5 file costs
    ~0.55 MB of HDF5's own memory and a descriptor; a reopen ~0.3 ms, paid per chunk written).

    Args:
        limit: most files open at once.
        stats: counts the parked files (``parked_files``).
    """

    def __init__(self, limit: int, stats: WriterStats | None = None) -> None:
        self.limit = max(1, int(limit))
        self._open: OrderedDict[int, OpenPart] = OrderedDict()
        self._stats = stats

    def __len__(self) -> int:
        return len(self._open)

    def open(self, part: OpenPart, opener: Callable[[], None]) -> None:
        """Make room (park the least recently used), then ``opener()`` opens ``part``'s file."""
        while len(self._open) >= self.limit:
            _, old = self._open.popitem(last=False)
            old.park()
            if self._stats is not None:
                self._stats.parked_files += 1
        opener()
        self._open[id(part)] = part

    def touch(self, part: OpenPart) -> None:
        """``part`` was just used (last to be parked)."""
        self._open.move_to_end(id(part))

    def release(self, part: OpenPart) -> None:
        """``part``'s file was closed for good (finished or aborted)."""
        self._open.pop(id(part), None)


@dataclass
class PartTools:
    """What every open part of a writer shares.

    Attributes:
        release: returns written bytes to the writer's budget (wakes a blocked ``write()``).
        files: the open-file limit of the parts (:class:`FileSlots`).
        scratch: the assembly buffer.
        current: the file the writer thread works on now, named by a failure's message.
        staged: bytes staged and not yet written, over every open part (kept as they change,
            so the writer checks its memory per batch in O(1), not by a walk over every handle).
        lent: bytes of the copies of shared blocks (:func:`take_shared_rows`) still in memory:
            their rows are staged as views, so a copy's bytes return to the budget when its last
            row is written (its memory is freed then), not row by row.
        lent_staged: bytes of those rows still staged (so ``lent - lent_staged`` is memory held
            by copies beyond their unwritten rows).
        index: bytes of the index entries the open parts hold (steps, calls, each field's record
            numbers, norms, ragged offsets and shapes), written when a part is finished: the
            writer seals every part when they reach :attr:`Budget.index_bytes`.
        root: the run directory (parts make their folders inside it, never it).
        hashes: parts store chunk hashes (:mod:`..hashes`).
    """

    release: Callable[[int], None]
    files: FileSlots = field(default_factory=lambda: FileSlots(64))
    scratch: Scratch = field(default_factory=Scratch)
    current: Path | None = None
    staged: int = 0
    lent: int = 0
    lent_staged: int = 0
    index: int = 0
    root: Path | None = None
    hashes: bool = True

    def lend(self, copy: np.ndarray) -> None:
        """``copy`` (a shared block's rows, copied once) is held by the views staged from it: its
        bytes stay counted against the budget until the last view is gone."""
        owner = copy  # (views chain to the array that owns the memory: it goes last)
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        self.lent += copy.nbytes
        weakref.finalize(owner, self._repay, copy.nbytes)

    def _repay(self, nbytes: int) -> None:
        self.lent -= nbytes
        self.release(nbytes)

    @property
    def held(self) -> int:
        """Memory the staged records hold: staged bytes, plus lent copies' bytes beyond their
        staged rows (a copy stays whole until its last row is written)."""
        return self.staged + self.lent - self.lent_staged


class StagedField:
    """A field's records in the open part that are not yet written to HDF5."""

    __slots__ = ("spec", "out", "arrays", "lent", "lent_items", "staged_items", "staged_bytes", "written_items",
                 "records", "norms", "offsets", "shapes", "item_bytes", "chunk_items", "entry_bytes")

    def __init__(self, spec: FieldSpec) -> None:
        self.spec = spec
        self.out: FieldOut | None = None
        self.arrays: deque[np.ndarray] = deque()  # runs: (m, *shape) fixed, flat 1-D ragged
        # Per run: whether it views a lent copy (its bytes are repaid with the copy, not when written).
        self.lent: deque[bool] = deque()
        self.lent_items = 0
        self.staged_items = 0  # records (fixed) or elements (ragged) staged
        self.staged_bytes = 0
        self.written_items = 0
        # The index of the part's entries, kept until the part is finished: flat arrays of
        # machine numbers (8 bytes an entry; lists of Python ints took ~36).
        self.records = array("q")
        self.norms = array("d")
        self.offsets = array("q")  # ragged
        self.shapes = array("q")  # ragged: ndim numbers per entry
        st = spec.info.storage
        self.item_bytes = st.itemsize if spec.ragged else st.itemsize * math.prod(spec.shape)
        self.chunk_items = 0  # known once the dataset exists
        #: Index bytes of one entry (record number, norm, ragged offset and shape).
        self.entry_bytes = 8 + 8 * spec.info.has_norm + (8 + 8 * spec.ndim if spec.ragged else 0)

    def batch_due(self) -> bool:
        """Whether a field without chunks of several items yet has a batch staged (see
        :data:`BATCH_BYTES`)."""
        return self.staged_bytes >= BATCH_BYTES or (not self.spec.ragged and self.staged_items >= BATCH_RECORDS)

    def chunk_full(self) -> bool:
        """Whether the staged items complete the current chunk."""
        return self.written_items % self.chunk_items + self.staged_items >= self.chunk_items


class OpenPart:
    """The part (``<key>.r<start>.h5seg.partial``) the writer thread is writing for one handle.

    Its HDF5 file may be parked between writes (:class:`FileSlots`).

    Args:
        start: global record number of its first record.
        partial: its path.
        make_file: creates the file (truncating ``partial``).
        tools: what the writer's open parts share.
    """

    def __init__(self, start: int, partial: Path, make_file: Callable[[], HandleFileWriter],
                 tools: PartTools) -> None:
        self.start = start
        self.partial = partial
        self._make_file = make_file
        self._file: HandleFileWriter | None = None
        self.tools = tools
        self.steps = array("q")  # (machine numbers, see StagedField.records)
        self.calls = array("q")
        self.fields: dict[str, StagedField] = {}
        self.index = 0  # bytes of its index entries (PartTools.index)
        #: The finished file's structure (:attr:`HandleFileWriter.structure`), set by :meth:`finish`.
        self.structure: Structure | None = None
        self._lean: dict[tuple, list[tuple[StagedField, np.dtype | None]]] = {}  # see lean_fields

    def file(self) -> HandleFileWriter:
        """The part's file, open: created, or reopened if parked (within the open-file limit)."""
        f = self._file
        if f is None:
            def create() -> None:
                if self.tools.root is None:
                    self.partial.parent.mkdir(parents=True, exist_ok=True)
                else:
                    make_folder(self.tools.root, self.partial.parent)
                self._file = self._make_file()
            self.tools.current = self.partial
            self.tools.files.open(self, create)
            f = self._file
        elif not f.is_open:
            self.tools.current = self.partial
            self.tools.files.open(self, f.resume)
        else:
            self.tools.files.touch(self)
        return f

    def park(self) -> None:
        """Close the file for now (:class:`FileSlots`); the next write reopens it."""
        if self._file is not None:
            self.tools.current = self.partial
            self._file.park()

    @property
    def end(self) -> int:
        """One past the last record number staged so far."""
        return self.start + len(self.steps)

    def staged_bytes(self) -> int:
        """Bytes staged and not written yet, over all fields."""
        return sum(sf.staged_bytes for sf in self.fields.values())

    def stage(self, steps: list[int], calls: list[int], fields: dict[str, tuple[np.ndarray, str]],
              ragged: set[str], compression_for: Callable[[str], str | None]) -> None:
        """Stage a block of ``len(steps)`` records (arrays ``(k, *shape)``); write the chunks it
        completes.

        Args:
            steps, calls: the records' steps and calls.
            fields: field name -> ``(array, dtype name)``; emptied (the part owns the arrays).
            ragged: the handle's fields stored ragged (a new field's layout).
            compression_for: a new field's compression spec.
        """
        first = self.end
        self.steps.extend(steps)
        self.calls.extend(calls)
        staged = []
        for name, (arr, dn) in fields.items():
            sf = self.fields.get(name)
            if sf is None:
                spec = FieldSpec(name, dn, name in ragged, arr.shape[1:], compression_for(name))
                sf = self.fields[name] = StagedField(spec)
            self._stage_field(sf, arr, dn, first)
            staged.append(sf)
        grown = len(steps) * (16 + sum(sf.entry_bytes for sf in staged))
        self.index += grown
        self.tools.index += grown
        # From here only the staged runs hold the records: a record's memory is gone when its
        # bytes return to the budget (a caller waiting for room then finds it free).
        fields.clear()
        arr = None
        for sf in staged:
            if sf.out is None or sf.chunk_items == 1:
                if sf.batch_due():
                    self.write_out(sf, full_only=True)
            elif sf.chunk_full():
                self.write_out(sf, full_only=True)

    def take_lent(self, lean: list[tuple[StagedField, np.dtype | None]], copies: list[np.ndarray], pos: int,
                  idx: list[int], steps: list[int], calls: list[int]) -> None:
        """Stage rows ``idx`` of a block of several handles' records as views of the block's lent
        copies (rows ``pos`` to ``pos + len(idx)``): the lean path of a shared block's records,
        one or two per handle, run by the writer thread (which holds the GIL meanwhile). The
        fields' checks are made once per part and layout (:meth:`lean_fields`), so a record
        costs a view and a few list appends.

        Args:
            lean: :meth:`lean_fields` of the block's layout.
            copies: the block's lent copies (:meth:`PartTools.lend`), one per field.
            pos: where this handle's rows start in the copies.
            idx: this handle's rows in the block, in block order.
            steps, calls: the whole block's.
        """
        first = self.start + len(self.steps)
        k = len(idx)
        if k == 1:
            i = idx[0]
            self.steps.append(steps[i])
            self.calls.append(calls[i])
        else:
            self.steps.extend([steps[i] for i in idx])
            self.calls.extend([calls[i] for i in idx])
        tools = self.tools
        grown = 16 * k
        for (sf, view), copy in zip(lean, copies):
            grown += k * sf.entry_bytes
            run = copy[pos : pos + k]
            if k == 1:
                sf.records.append(first)
            else:
                sf.records.extend(range(first, first + k))
            if view is not None:
                run = run.view(view)
            sf.arrays.append(run)
            sf.lent.append(True)
            sf.lent_items += k
            sf.staged_items += k
            nbytes = run.nbytes
            sf.staged_bytes += nbytes
            tools.staged += nbytes
            tools.lent_staged += nbytes
            if sf.out is None or sf.chunk_items == 1:
                if sf.batch_due():
                    self.write_out(sf, full_only=True)
            elif sf.chunk_full():
                self.write_out(sf, full_only=True)
        self.index += grown
        tools.index += grown

    def lean_fields(self, sig: tuple) -> list[tuple[StagedField, np.dtype | None]] | None:
        """The staged fields a block of layout ``sig`` (``((name, dtype name, numpy dtype,
        record shape), ...)``) goes to, each with the dtype its rows are viewed as (None: as
        they are); None when a field is new, ragged or of another shape or dtype here (the
        block's rows then go the general way)."""
        lean = self._lean.get(sig)
        if lean is None:
            lean = self._lean_fields(sig)
        return lean

    def _lean_fields(self, sig: tuple) -> list[tuple[StagedField, np.dtype | None]] | None:
        """The staged fields a block of layout ``sig`` goes to, each with the dtype its rows are
        viewed as (None: as they are); None when a field is new, ragged or of another shape or
        dtype here. Kept per layout: a part's fields are never replaced."""
        out = []
        for name, dn, dtype, shape in sig:
            sf = self.fields.get(name)
            if sf is None or sf.spec.ragged or sf.spec.shape != shape or sf.spec.dtype_name != dn:
                return None
            storage = sf.spec.info.storage
            out.append((sf, None if storage == dtype else storage))
        self._lean[sig] = out
        return out

    def _stage_field(self, sf: StagedField, arr: np.ndarray, dn: str, first: int) -> None:
        """Add one field's run of records (numbered from ``first``) to what is staged."""
        k = len(arr)
        if not arr.flags.c_contiguous or not arr.dtype.isnative:
            arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("="))
        if sf.spec.info.storage != arr.dtype:
            arr = arr.view(sf.spec.info.storage)  # signed bits -> unsigned storage, same width
        sf.records.extend(range(first, first + k))
        if sf.spec.ragged:
            for one in arr:
                if sf.spec.info.has_norm:
                    sf.norms.append(l2(one, dn))  # fixed fields: per block in _write_items
                sf.offsets.append(sf.written_items + sf.staged_items)
                sf.shapes.extend(one.shape)
                flat = one.reshape(-1)
                sf.arrays.append(flat)
                sf.lent.append(False)
                sf.staged_items += flat.size
        else:
            sf.arrays.append(arr)  # a run of k records, written (or split) by _write_items
            sf.lent.append(False)
            sf.staged_items += k
        sf.staged_bytes += arr.nbytes
        self.tools.staged += arr.nbytes

    def _ensure_out(self, sf: StagedField) -> FieldOut:
        """The field's dataset, created on first use with chunks sized for what is staged."""
        if sf.out is None:
            floor = max(1, MIN_FIRST_CHUNK_BYTES // max(1, sf.item_bytes))
            sf.out = self.file().field(sf.spec, max(sf.staged_items, floor))
            sf.chunk_items = sf.out.chunk[0]
        return sf.out

    def write_out(self, sf: StagedField, full_only: bool) -> None:
        """Write staged items of one field: up to the last chunk boundary (``full_only``) or all."""
        if not sf.staged_items:
            return
        self._ensure_out(sf)
        c = sf.chunk_items
        if full_only:
            k = ((sf.written_items + sf.staged_items) // c) * c - sf.written_items
            if k <= 0:
                return
        else:
            k = sf.staged_items
        piece = max(c, PIECE_BYTES // max(1, sf.item_bytes))
        while k > piece:
            self._write_items(sf, piece)
            k -= piece
        self._write_items(sf, k)

    def _write_items(self, sf: StagedField, k: int) -> None:
        """Write the first ``k`` staged items of a field (one resize + one write / direct chunks)."""
        spec = sf.spec
        out = self._ensure_out(sf)
        self.file()  # (open: a parked file is reopened)
        self.tools.current = self.partial
        runs, lent = _take(sf, k)
        block = None
        if not spec.ragged and out.direct and sf.chunk_items == 1:
            if spec.info.has_norm:
                for r in runs:
                    sf.norms.frombytes(np.asarray(row_norms(r, spec.dtype_name), np.float64).tobytes())
            out.append_records([rec for r in runs for rec in r])
        else:
            if len(runs) == 1:
                block = runs[0]  # a whole run (e.g. a recorder's chunk-sized block): no copy
            else:
                # One call: one GIL release, not one per run.
                shape = (k,) if spec.ragged else (k, *spec.shape)
                block = self.tools.scratch.view(k * sf.item_bytes, spec.info.storage, shape)
                np.concatenate(runs, axis=0, out=block)
            if not spec.ragged and spec.info.has_norm:
                # One batched computation per block: per-record numpy calls would release and
                # re-acquire the GIL once per record (measured 20 us each under contention).
                sf.norms.frombytes(np.asarray(row_norms(block, spec.dtype_name), np.float64).tobytes())
            out.append(block)
        del runs, block  # the records' memory goes before their bytes return to the budget
        written = k * sf.item_bytes
        sf.staged_items -= k
        sf.written_items += k
        sf.staged_bytes -= written
        tools = self.tools
        tools.staged -= written
        if lent:  # (their bytes return with their copy, once its last row is written)
            sf.lent_items -= lent
            tools.lent_staged -= lent * sf.item_bytes
        tools.release(written - lent * sf.item_bytes)

    def finish(self) -> None:
        """Write everything staged and every index; close the file (still ``.partial``)."""
        self.tools.current = self.partial
        for sf in self.fields.values():
            if sf.out is None:  # (all of the field's records in this file are staged: chunks sized to them)
                sf.out = self.file().field(sf.spec, max(1, sf.staged_items))
                sf.chunk_items = sf.out.chunk[0]
            self.write_out(sf, full_only=False)
            out = self._ensure_out(sf)
            out.records.append(np.asarray(sf.records, np.int64))
            if sf.spec.info.has_norm:
                out.norms.append(np.asarray(sf.norms, np.float64))
            if sf.spec.ragged:
                out.offsets.append(np.asarray(sf.offsets, np.int64))
                out.shapes.append(np.asarray(sf.shapes, np.int64).reshape(len(sf.offsets), sf.spec.ndim))
        f = self.file()
        f.add_index(np.asarray(self.steps, np.int64), np.asarray(self.calls, np.int64))
        self.tools.files.release(self)
        f.finish()
        self.structure = f.structure
        self.tools.index -= self.index
        self.index = 0

    def abort(self) -> None:
        """Close the file without finishing it (after a failure; it stays ``.partial``)."""
        self.tools.staged -= self.staged_bytes()
        self.tools.lent_staged -= sum(sf.lent_items * sf.item_bytes for sf in self.fields.values())
        self.tools.index -= self.index
        self.index = 0
        self.tools.files.release(self)
        if self._file is not None:
            self._file.abort()


def _take(sf: StagedField, k: int) -> tuple[list[np.ndarray], int]:
    """Pop the first ``k`` items (along axis 0) off a field's staged runs, splitting a run when
    needed; returns the pieces in order, and how many of the items view lent copies."""
    runs, lent = sf.arrays, sf.lent
    pieces = []
    n_lent = 0
    while k:
        a = runs[0]
        if len(a) <= k:
            pieces.append(runs.popleft())
            if lent.popleft():
                n_lent += len(a)
            k -= len(a)
        else:
            pieces.append(a[:k])
            runs[0] = a[k:]
            if lent[0]:
                n_lent += k
            k = 0
    return pieces, n_lent


def take_shared_rows(groups: dict[Any, list[int]], sig: tuple, arrs: list[np.ndarray], steps: list[int],
                     calls: list[int]) -> set[Any]:
    """Stage the rows of a shared block (records of several handles, in ``arrs``) of every
    handle whose open part already holds the block's fields (:meth:`OpenPart.lean_fields`).

    Their rows are copied once, in one call per field (into fresh memory: one large copy, not
    one small allocation and copy per record, which cost the writer thread ~3 us a record at
    5,000 handles), and each handle's part stages views of its rows. The copy is lent
    (:meth:`PartTools.lend`): its bytes stay counted against the budget until its last row is
    written.

    Args:
        groups: handle -> its rows in the block, in block order; a handle has ``part`` (its
            :class:`OpenPart` or None).
        sig: the block's layout, ``((name, dtype name, numpy dtype, record shape), ...)``.
        arrs: the block's arrays, one per entry of ``sig``.
        steps, calls: the block's.

    Returns:
        The handles whose rows were staged (the others go the general way).
    """
    lean = []
    taken = set()
    order: list[int] = []
    for h, idx in groups.items():
        part = h.part
        if part is not None:
            fields = part.lean_fields(sig)
            if fields is not None:
                lean.append((part, fields, idx))
                taken.add(h)
                order += idx
    if not lean:
        return taken
    whole = len(order) == len(arrs[0]) and order == list(range(len(order)))
    copies = [arr.copy() if whole else arr[order] for arr in arrs]
    tools = lean[0][0].tools
    for copy in copies:
        tools.lend(copy)
    pos = 0
    for part, fields, idx in lean:
        part.take_lent(fields, copies, pos, idx, steps, calls)
        pos += len(idx)
    return taken
