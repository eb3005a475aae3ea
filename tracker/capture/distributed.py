"""torch.distributed glue for the Recorder: rank detection, run-id broadcast, agreement checks.

Only torch's own process groups are used (``broadcast_object_list``, ``all_gather_object``); the
collectives run at Recorder construction and close, never inside hooks. A process group destroyed
before ``close()`` costs only the close-time check: the rank's files close completely.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch.distributed as dist

from hookline.storage.errors import InvalidArgumentError

__all__ = ["DistInfo", "detect", "broadcast_run_id", "check_same_handles", "gather", "group_gone"]

log = logging.getLogger("hookline")


class DistInfo:
    """Rank information of one recorder.

    Attributes:
        rank, world_size: ``None`` for a single-process run.
        collective: whether a ``torch.distributed`` process group is initialised, so
            collectives can be used to agree on the MLflow run id and the handle sets.
    """

    def __init__(self, rank: int | None, world_size: int | None, collective: bool) -> None:
        self.rank, self.world_size, self.collective = rank, world_size, collective
        self.warned = False  # (group_gone said it once)

    @property
    def is_main(self) -> bool:
        """Rank 0, or a single-process run."""
        return not self.rank


def detect(rank: int | None = None, world_size: int | None = None) -> DistInfo:
    """Use the given rank/world size, else those of an initialised default process group.

    A world of size 1 counts as single-process (plain file names, no collectives).
    """
    initialised = dist.is_available() and dist.is_initialized()
    if rank is None and world_size is None and initialised:
        rank, world_size = dist.get_rank(), dist.get_world_size()
    if (rank is None) != (world_size is None):
        raise InvalidArgumentError(
            f"give both rank and world_size (got rank={rank!r}, world_size={world_size!r}), or "
            "neither to take them from torch.distributed"
        )
    if world_size is not None:
        if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise InvalidArgumentError(
                f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}"
            )
        if world_size == 1:
            rank = world_size = None
    collective = bool(initialised and world_size is not None and world_size == dist.get_world_size())
    return DistInfo(rank, world_size, collective)


def broadcast_run_id(info: DistInfo, run_id: str | None) -> str | None:
    """Rank 0's MLflow run id on every rank (rank 0 owns the run).

    Other ranks may pass ``None`` (they learn the id) or the same id; a different id is an
    error on every rank (raised after the collective, so no rank hangs).
    """
    if not info.collective:
        return run_id
    obj = [run_id]
    dist.broadcast_object_list(obj, src=0)
    main_id = obj[0]
    mine = [run_id]
    gathered: list[list[str | None]] = [[None]] * int(info.world_size or 1)
    dist.all_gather_object(gathered, mine)
    conflicts = {r: g[0] for r, g in enumerate(gathered) if g[0] is not None and g[0] != main_id}
    if conflicts:
        raise InvalidArgumentError(
            f"ranks disagree on mlflow_run_id: rank 0 has {main_id!r}, "
            + ", ".join(f"rank {r} has {v!r}" for r, v in sorted(conflicts.items()))
            + "; pass the id on rank 0 only (the others receive it) or the same id everywhere"
        )
    return main_id


def gather(info: DistInfo, value: Any) -> list[Any]:
    """Every rank's ``value`` (rank order) under a process group, else ``[value]``."""
    if not info.collective:
        return [value]
    gathered: list[Any] = [None] * int(info.world_size or 1)
    dist.all_gather_object(gathered, value)
    return gathered


def group_gone(info: DistInfo, what: str) -> bool:
    """Whether the process group this recorder started under was destroyed before ``what`` (a
    collective) could run; if so, say so once on the ``hookline`` logger."""
    if not info.collective or dist.is_initialized():
        return False
    if not info.warned:
        info.warned = True
        log.warning("hookline: the torch.distributed process group was destroyed before Recorder.close() "
                    "on rank %s, so %s was skipped (no collective possible); this rank's files are "
                    "complete. Close the recorder before dist.destroy_process_group() to keep the check",
                    info.rank, what)
    return True


def check_same_handles(info: DistInfo, handle_ids: Sequence[str]) -> None:
    """Raise on every rank when the ranks recorded different sets of hook handles (skipped, said
    once, when the process group is gone: :func:`group_gone`)."""
    if not info.collective or group_gone(info, "comparing the ranks' handle sets"):
        return
    gathered: list[list[str] | None] = [None] * int(info.world_size or 1)
    dist.all_gather_object(gathered, sorted(handle_ids))
    ref = set(gathered[0] or [])
    diffs = []
    for r, ids in enumerate(gathered):
        s = set(ids or [])
        if s != ref:
            diffs.append(
                f"rank {r} lacks {sorted(ref - s)!r} and adds {sorted(s - ref)!r} compared to rank 0"
            )
    if diffs:
        raise InvalidArgumentError(
            "ranks registered different hook handles: " + "; ".join(diffs)
            + "; register the same recorder hooks on every rank"
        )
