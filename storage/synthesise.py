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

from .confine import RunRoot
from .errors import FormatError
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
                a = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
        except OSError:
            continue
        if a.get("hookline_format") != FILE_FORMAT:
            continue
        if not p.relative_to(root).as_posix().startswith(f"{a.get('key')}."):
            continue  # not where its key puts it: a file of another run (copied or nested)
        rank, ws = int(a.get("rank", -1)), int(a.get("world_size", -1))
        m = by_rank.setdefault((rank, ws), {
            "format": RUN_FORMAT, "format_version": FORMAT_VERSION, "status": "unknown",
            "rank": None if rank < 0 else rank, "world_size": None if ws < 0 else ws,
            "meta": _run_meta(a), "handles": {}})
        for attr, key in (("run_uuid", "run_uuid"), ("run_created", "created")):  # the run's identity
            if a.get(attr) and key not in m:
                m[key] = str(a[attr])
        hid = str(a["handle_id"])
        m["handles"].setdefault(hid, {
            "key": str(a["key"]), "file": f"{a['key']}{rank_suffix(m['rank'], m['world_size'])}.h5",
            "module_name": str(a.get("module_name", "")), "module_type": str(a.get("module_type", "")),
            "category": str(a.get("category", "")), "hook_fn_name": str(a.get("hook_fn_name", "")),
            "meta": json.loads(a.get("meta", "{}")), "fields": {}})
    return [by_rank[k] for k in sorted(by_rank)]


def _run_meta(attrs: dict[str, Any]) -> dict[str, Any]:
    """The run metadata a file's ``run_meta`` attribute holds ({} when absent or not a JSON object)."""
    try:
        meta = json.loads(attrs.get("run_meta") or "{}")
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}
