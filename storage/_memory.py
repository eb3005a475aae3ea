"""Giving memory the writer freed back to the kernel (glibc's ``malloc_trim``).

glibc's malloc keeps freed memory in its heaps for reuse. Its mmap threshold grows to the
largest block freed (up to 32 MiB), so after the first ~1 MiB block is freed every later one of
that size comes from a heap, and a heap gives memory back only from its top. glibc keeps a heap
per thread: the records queued while the writer thread writes sit in the caller's heap, the
copies of shared blocks in the writer's, and each heap keeps its own high-water mark, so their
sum can exceed the budget + 64 MB (docs/storage.md, Memory budget). The process-wide settings
(``mallopt``, ``MALLOC_*`` variables) stay the user's: they would change torch's own allocations
too. Instead, :class:`Trimmer` calls ``malloc_trim(0)`` (every heap: its free pages go back to
the kernel with ``madvise``) once the writer has freed a share of its budget. Where glibc is not
the C library (musl, macOS, Windows) it does nothing.
"""

from __future__ import annotations

import ctypes
import sys
import time
from typing import Callable

__all__ = ["TRIM_AVAILABLE", "Trimmer", "malloc_trim"]


def _find_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded: the process's own C library
        libc.gnu_get_libc_version  # glibc only (musl has no such function)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_TRIM = _find_trim()
#: Whether :func:`malloc_trim` does anything here (glibc).
TRIM_AVAILABLE = _TRIM is not None


def malloc_trim() -> bool:
    """Give the free memory of every malloc heap back to the kernel (glibc); False elsewhere."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class Trimmer:
    """Calls :func:`malloc_trim` once ``every`` bytes were freed since the last call.

    A trim walks every heap's free memory and hands its free pages to the kernel (~20 ms when
    300 MB were freed, ~0.02 ms when nothing was), and the pages it returns are faulted in again
    when reused (~0.7 ms per MB): so it runs per share of the budget freed, not per record.

    Used by the writer thread (a count lost to a race with another thread only moves a trim).

    Args:
        every: bytes freed between two trims.
    """

    #: Most bytes freed between two trims, whatever the budget (what a heap may keep meanwhile).
    EVERY_MAX = 32 << 20
    #: Fewest: a small budget's writer does not trim per record (what a heap keeps meanwhile lies
    #: well within the 64 MB over the budget).
    EVERY_MIN = 4 << 20

    def __init__(self, every: int) -> None:
        self.every = max(1, int(every))
        self.freed = 0
        #: Trims made and the seconds they took (statistics: tests, benchmarks).
        self.trims = 0
        self.seconds = 0.0

    @classmethod
    def for_budget(cls, budget_bytes: int) -> Trimmer:
        """The trimmer of a writer with this budget: a trim per eighth of it freed, between
        :attr:`EVERY_MIN` and :attr:`EVERY_MAX`."""
        return cls(max(cls.EVERY_MIN, min(budget_bytes // 8, cls.EVERY_MAX)))

    def note(self, nbytes: int) -> None:
        """``nbytes`` were freed."""
        self.freed += nbytes

    def maybe_trim(self) -> bool:
        """Trim if ``every`` bytes were freed since the last trim; returns whether it trimmed."""
        if self.freed < self.every or _TRIM is None:
            return False
        self.freed = 0
        t = time.perf_counter()
        malloc_trim()
        self.seconds += time.perf_counter() - t
        self.trims += 1
        return True

