"""Manifests rebuilt from the handle files' own attributes, for a run directory without one.

A writer stores each handle's registration and the run's metadata in the attributes of every
complete file (final ``.h5`` and sealed ``.h5seg``), so a run whose writer was killed before its
first manifest write, or whose manifest was lost, can still be read (:class:`.reader.LocalSource`)
and repaired (:func:`.verify.verify`). Only files where their key puts them count: a file copied
or nested from another run is not part of this one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .confine import RunRoot
from .errors import FormatError
from ._h5check import root_attrs
from .identity import is_utf8
from .format import FILE_FORMAT, FORMAT_VERSION, RUN_FORMAT, rank_suffix

__all__ = ["synthesise_manifests"]


def synthesise_manifests(root: Path) -> list[dict[str, Any]]:
    """Manifests (one per rank, lowest first) built from the attributes of every complete
    hookline file under ``root``, with status ``"unknown"`` and no record counts.

    Args:
        root: the run directory.

    Returns:
        The manifests; empty when ``root`` holds no hookline file of its own.
    """
    by_rank: dict[tuple[int, int], dict[str, Any]] = {}
    confined = RunRoot(root)
    for p in sorted(list(root.rglob("*.h5")) + list(root.rglob("*.h5seg"))):
        try:  # (a FIFO or a symlink out of the run is never opened: verify reports it)
            confined.file(p.relative_to(root).as_posix(), what="file")
        except FormatError:
            continue
        try:
            with h5py.File(p, "r", rdcc_nbytes=0) as f:
                a = root_attrs(f, str(p))
        except Exception:  # (not HDF5, or damaged: verify reports the files of a handle it knows)
            continue
        hid, key = a.get("handle_id"), a.get("key")
        if (a.get("hookline_format") != FILE_FORMAT or not isinstance(hid, str) or not isinstance(key, str)
                or not is_utf8(hid)):  # (a name that does not decode is damage, never a handle: verify says so)
            continue
        if not p.relative_to(root).as_posix().startswith(f"{key}."):
            continue  # not where its key puts it: a file of another run (copied or nested)
        rank, ws = _int(a.get("rank")), _int(a.get("world_size"))
        m = by_rank.setdefault((rank, ws), {
            "format": RUN_FORMAT, "format_version": FORMAT_VERSION, "status": "unknown",
            "rank": None if rank < 0 else rank, "world_size": None if ws < 0 else ws,
            "meta": _json_object(a.get("run_meta")), "handles": {}})
        for attr, mkey in (("run_uuid", "run_uuid"), ("run_created", "created")):  # the run's identity
            if isinstance(a.get(attr), str) and a[attr] and mkey not in m:
                m[mkey] = a[attr]
        m["handles"].setdefault(hid, {
            "key": key, "file": f"{key}{rank_suffix(m['rank'], m['world_size'])}.h5",
            "module_name": str(a.get("module_name", "")), "module_type": str(a.get("module_type", "")),
            "category": str(a.get("category", "")), "hook_fn_name": str(a.get("hook_fn_name", "")),
            "meta": _json_object(a.get("meta")), "fields": {}})
    return [by_rank[k] for k in sorted(by_rank)]


def _int(v: Any) -> int:
    """An int attribute, or -1 when absent or not an int."""
    return int(v) if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) else -1


def _json_object(text: Any) -> dict[str, Any]:
    """A JSON-object attribute (``meta``, ``run_meta``), or {} when absent or not a JSON object
    (a damaged file's handle is still listed, so that verify reports the file)."""
    try:
        obj = json.loads(text) if isinstance(text, str) else None
    except (ValueError, RecursionError):
        return {}
    return obj if isinstance(obj, dict) else {}
