"""The buffered background writer of a run directory: :class:`RunWriter` (design in docs/storage.md).

Its rooms, one job each:

* :mod:`.run_writer` — :class:`RunWriter`, the public API (validation, write/flush/close, stats);
* :mod:`.checks` — what callers hand it, checked on their own thread;
* :mod:`.handle` — one declared handle: its fields' registry and its parts' state;
* :mod:`.queue` — messages to the writer thread within the memory budget (backpressure);
* :mod:`.thread` — the writer thread's loop: staging, flush, close, failure;
* :mod:`.staging` — the part being written: records staged per field, whole chunks written;
* :mod:`.open_parts` — the open parts: opened within ``max_open_files``, sealed, published;
* :mod:`.merging` — compaction of sealed parts and the final ``<key>.h5`` at close;
* :mod:`.manifest` — the run's identity and its manifest;
* :mod:`.context`, :mod:`.failure`, :mod:`.norms`, :mod:`.stats` — shared state, error messages,
  record norms, counters.
"""

from __future__ import annotations

from .run_writer import RunWriter
from .stats import HandleStats, WriterStats

__all__ = ["RunWriter", "WriterStats", "HandleStats"]
