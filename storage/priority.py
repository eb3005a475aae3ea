"""The scheduling priority of the writer's background threads (``writer_priority``).

The writer's threads share the machine's cores with the training thread and with torch's
intra-op (OpenMP) threads. An OpenMP parallel region waits for its slowest thread, so a writer
thread that the kernel runs in the middle of one stalls every thread of that region, not just
the one it displaced. Lowering the writer threads' priority lets the kernel run them in the gaps
(between parallel regions, while the training thread runs Python) instead. Measured in
``tests/benchmarks/bench_contention.py``; the choice is documented in docs/internals/capture.md.

Policies (Linux; elsewhere both run as ``"normal"``):

* ``"normal"``: the training thread's own priority;
* ``"nice"``: nice 19 for the writer's threads only (Linux keeps a nice value per thread).

Not offered: ``SCHED_IDLE``. The writer thread holds the GIL for parts of its work; starved
while holding it, it made the training thread wait for the GIL for up to 75% of its time
(measured, docs/performance.md).

Lowering is allowed to any user; raising it back is not, so a thread is lowered once, from
itself, when it starts (threads it starts inherit the setting).
"""

from __future__ import annotations

import os
import sys

from .errors import InvalidArgumentError

__all__ = ["PRIORITIES", "WRITER_PRIORITY", "check_priority", "lower_this_thread"]

PRIORITIES = ("normal", "nice")

#: The Recorder's default (measured: docs/performance.md, "Contention: the GIL, the cores and the
#: writer's priority").
WRITER_PRIORITY = "nice"

#: The nice value of ``"nice"`` (the lowest priority of the normal policy).
NICE = 19


def check_priority(value: object) -> str:
    """``value`` if it names a policy of :data:`PRIORITIES`, else :class:`InvalidArgumentError`."""
    if not isinstance(value, str) or value not in PRIORITIES:
        raise InvalidArgumentError(
            f"writer_priority must be one of {', '.join(map(repr, PRIORITIES))}, got {value!r:.60}: "
            "'nice' runs the writer's threads at nice 19, 'normal' at the training thread's priority")
    return value


def lower_this_thread(policy: str) -> bool:
    """Apply ``policy`` to the calling thread; True when the kernel took it.

    Never raises: a platform or sandbox that refuses keeps the thread at its priority (the
    writer works the same, only less politely).
    """
    if policy == "normal" or not sys.platform.startswith("linux"):
        return False
    tid = 0  # Linux: 0 is the calling thread for both calls (per-thread attributes)
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(NICE, os.getpriority(os.PRIO_PROCESS, tid)))
    except (OSError, AttributeError):
        return False
    return True
