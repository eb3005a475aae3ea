"""Opening a recorder's run: the metadata it writes, and the refusal to mix into another run."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hookline.storage.errors import HookTypeError, InvalidArgumentError, RunExistsError, StorageError
from hookline.storage.format import MANIFEST_RE, manifest_name, read_manifest

from .distributed import DistInfo, gather
from .sampling import steps_meta

__all__ = ["OWN_META", "check_meta", "check_run_dir", "held_run", "refuse_held_run", "run_metadata"]

#: Run metadata keys the recorder writes itself (a user's ``meta=`` may not override them).
OWN_META = ("torch_version", "every", "steps", "mlflow_run_id")


def check_run_dir(run_dir: Any) -> Path:
    """``run_dir`` as a Path.

    Raises:
        HookTypeError: not a str or os.PathLike.
    """
    if not isinstance(run_dir, (str, os.PathLike)):
        raise HookTypeError(
            f"Recorder needs a run directory path (str or os.PathLike), got "
            f"{type(run_dir).__name__} {run_dir!r:.80}; e.g. Recorder('runs/baseline')"
        )
    return Path(run_dir)


def check_meta(meta: Any, resume: Any = False) -> None:
    """Validate a user's ``meta=`` (a mapping that overrides none of :data:`OWN_META`) and
    ``resume=`` (:func:`check_resume`).

    Raises:
        HookTypeError: ``meta`` is not a mapping, or ``resume`` not a bool.
        InvalidArgumentError: ``meta`` holds a key the recorder writes itself.
    """
    check_resume(resume)
    if meta is not None and not isinstance(meta, Mapping):
        raise HookTypeError(f"meta must be a dict of run metadata, got {type(meta).__name__} {meta!r:.60}")
    if meta is not None:
        own = [k for k in meta if k in OWN_META]
        if own:
            raise InvalidArgumentError(
                f"meta key {own[0]!r} is written by the recorder itself ({', '.join(OWN_META)}); "
                f"rename yours (e.g. 'user_{own[0]}')")


def check_resume(resume: Any) -> bool:
    """``resume=`` is a bool (a string such as ``'yes'`` or ``'false'`` would read as True).

    Raises:
        HookTypeError: not a bool.
    """
    if not isinstance(resume, bool):
        raise HookTypeError(f"resume must be True or False, got {type(resume).__name__} {resume!r:.60}")
    return resume


def run_metadata(
    every: int, steps: frozenset[int] | None, meta: Mapping[str, Any] | None, mlflow_run_id: str | None
) -> dict[str, Any]:
    """The run metadata every handle file and the manifest carry: the recorder's own keys
    (:data:`OWN_META`) and the user's ``meta``."""
    run_meta = {"torch_version": torch.__version__, "every": every, "steps": steps_meta(steps),
                **(meta or {})}
    if mlflow_run_id is not None:
        run_meta["mlflow_run_id"] = mlflow_run_id
    return run_meta


def refuse_held_run(info: DistInfo, run_dir: Path) -> None:
    """Raise RunExistsError on every rank when some rank's ``run_dir`` holds a run (see
    :func:`held_run`). Agreed between ranks (a collective before any rank creates a file), so
    every rank raises, or none does."""
    held = [h for h in gather(info, held_run(run_dir, info.rank, info.world_size)) if h]
    if held:
        raise RunExistsError(
            f"{str(run_dir)!r} already holds a run ({held[0]}); record into a new "
            f"directory, or pass resume=True to continue that run (e.g. after a crash)")


def held_run(run_dir: Path, rank: int | None, world_size: int | None) -> str | None:
    """What shows that ``run_dir`` already holds a run this recorder would mix into, or None.

    Any manifest does (whatever its rank layout), except another rank's manifest of a run with
    this world size (this run's own ranks, when they start at different times); so do handle
    files without a manifest (which a writer would continue).
    """
    try:
        names = sorted(p.name for p in run_dir.iterdir())
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StorageError(f"cannot list run directory {str(run_dir)!r}: {e}") from e
    mine = manifest_name(rank, world_size)
    for name in names:
        m = MANIFEST_RE.fullmatch(name)
        if m is None:
            continue
        if name == mine or world_size is None or m.group(1) is None:
            return name
        try:
            other_ws = read_manifest(run_dir / name).get("world_size")
        except Exception:  # noqa: BLE001 - unreadable: still a run's manifest
            return name
        if other_ws != world_size:
            return f"{name}, recorded with world_size={other_ws}"
    if any(MANIFEST_RE.fullmatch(n) for n in names):
        return None  # another rank's of this run: its files are its own
    for pattern in ("*.h5", "*.h5seg", "*.h5seg.partial"):  # handle files live in subdirectories
        found = next(run_dir.rglob(pattern), None)
        if found is not None:
            return f"{found.relative_to(run_dir)}, without a manifest"
    return None
