"""What the writer's background threads share: the run's settings, its identity and their tools."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from .._filters import CompressionRules
from .._fs import Writeback
from .manifest import RunIdentity
from .staging import PartTools

__all__ = ["WriterContext"]


@dataclass
class WriterContext:
    """Settings and shared state of one writer's background threads.

    Attributes:
        run_dir: the run directory.
        fsync: fsync files and directories at flush/close.
        compression: the writer's per-field compression.
        writeback_bytes: writeback interval of a merge's output (a merge has a file of its own).
        writeback: writeback shared by the open parts (writer thread).
        identity: the run (attributes of every new part).
        tools: what the open parts share (assembly buffer, budget release, the current file).
        priority: the scheduling policy of the background threads (:mod:`..priority`).
        sealed_lock: guards every handle's :attr:`~.WriterHandle.sealed` list: the writer thread
            appends sealed parts and the compactor replaces runs of them with merged ones.
    """

    run_dir: Path
    fsync: bool
    compression: CompressionRules
    writeback_bytes: int
    writeback: Writeback
    identity: RunIdentity
    tools: PartTools
    priority: str = "normal"
    sealed_lock: threading.Lock = field(default_factory=threading.Lock)
