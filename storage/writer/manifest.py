"""What a run says about itself: its identity (kept across continued runs), in every part's
attributes and in the manifest the writer builds and writes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from .._fs import atomic_write_json
from ..confine import RunRoot
from ..format import (
    FORMAT_VERSION,
    MANIFEST_RE,
    RUN_FORMAT,
    final_name,
    hookline_version,
    now_iso,
    read_manifest,
    run_identity,
)
from .handle import WriterHandle

__all__ = ["ManifestWriter", "RunIdentity"]


@dataclass
class RunIdentity:
    """The run a writer writes: rank layout, metadata, and what a continued run keeps.

    Attributes:
        rank, world_size: as given to the writer.
        meta: the run metadata (JSON data).
        uuid: identifies the run directory (e.g. to an MLflow run); kept when a run is continued.
        created: when the run was first created.
        previous: the handles of the manifest a continued run had (handle id -> entry).
    """

    rank: int | None
    world_size: int | None
    meta: dict[str, Any]
    uuid: str
    created: str
    previous: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, run_dir: Path, manifest_path: Path, rank: int | None, world_size: int | None,
             meta: dict[str, Any], new_uuid: str) -> RunIdentity:
        """The identity of the run at ``run_dir``: a continued run keeps its creation time, uuid
        and handles from its manifest (a broken one is ignored: verify() reports it and the writer
        rewrites it); a run continued at another world size keeps the uuid of another rank layout's
        manifest."""
        ident = cls(rank, world_size, meta, new_uuid, now_iso())
        confined = RunRoot(run_dir)  # (a FIFO or a symlink out of the run is not read)
        if manifest_path.exists() or manifest_path.is_symlink():
            try:
                old = read_manifest(confined.file(manifest_path.name, what="manifest"))
                ident.created = old.get("created", ident.created)
                ident.uuid = run_identity(old) or ident.uuid
                ident.previous = dict(old.get("handles", {}))
            except Exception:
                pass  # verify() reports broken manifests; we rewrite it
            return ident
        # manifest.json -> manifest.rank<r>.json: still the same run, for the MLflow run it is synced to.
        for other in sorted(p for p in run_dir.glob("*.json") if MANIFEST_RE.fullmatch(p.name)):
            try:
                ident.uuid = run_identity(read_manifest(confined.file(other.name, what="manifest"))) or ident.uuid
                break
            except Exception:
                continue
        return ident

    def file_attrs(self, h: WriterHandle) -> dict[str, Any]:
        """Root attributes of a new part of ``h`` (they also rebuild a lost manifest)."""
        i = h.info
        return {
            "handle_id": h.id, "key": h.key, "module_name": i["module_name"], "module_type": i["module_type"],
            "category": i["category"], "hook_fn_name": i["hook_fn_name"],
            "rank": np.int64(-1 if self.rank is None else self.rank),
            "world_size": np.int64(-1 if self.world_size is None else self.world_size),
            "hookline_version": hookline_version(), "meta": json.dumps(i["meta"]),
            "run_meta": json.dumps(self.meta), "created": now_iso(),
            "run_uuid": self.uuid, "run_created": self.created,  # (a lost manifest is rebuilt)
        }


class ManifestWriter:
    """Builds and writes a writer's manifest (writer thread).

    Args:
        path: the manifest's path.
        identity: the run.
        fsync: write it durably.
    """

    def __init__(self, path: Path, identity: RunIdentity, fsync: bool) -> None:
        self.path = path
        self.identity = identity
        self.fsync = fsync
        #: Set when the manifest no longer says what is on disk (a handle started).
        self.dirty = False

    def build(self, status: str, handles: Iterable[WriterHandle], error: str | None) -> dict[str, Any]:
        """The manifest: ``status`` (``"open"``, ``"closed"``, ``"failed"``), the handles in
        declaration order (merged with a continued run's), the background error if any."""
        ident = self.identity
        entries: dict[str, Any] = dict(ident.previous)
        for h in handles:
            entries[h.id] = _handle_entry(h, ident.previous.get(h.id, {}))
        return {
            "format": RUN_FORMAT, "format_version": FORMAT_VERSION, "hookline_version": hookline_version(),
            "created": ident.created, "updated": now_iso(), "status": status, "run_uuid": ident.uuid,
            "rank": ident.rank, "world_size": ident.world_size, "meta": ident.meta,
            "dropped": sum(int(v.get("dropped", 0)) for v in entries.values()),
            "error": error,
            "handles": entries,
        }

    def write(self, status: str, handles: Iterable[WriterHandle], error: str | None) -> None:
        """Build the manifest and replace the file atomically."""
        m = self.build(status, handles, error)
        try:
            json.dumps(m)
        except (TypeError, ValueError):
            m["meta"] = self.identity.meta
        atomic_write_json(self.path, m, fsync=self.fsync)
        self.dirty = False


def _handle_entry(h: WriterHandle, old: dict[str, Any]) -> dict[str, Any]:
    """A handle's manifest entry (``old``: its entry in a continued run's manifest)."""
    steps = old.get("steps")
    if h.steps_min is not None:
        lo, hi = h.steps_min, h.steps_max
        if steps:
            lo, hi = min(lo, steps[0]), max(hi, steps[1])
        steps = [lo, hi]
    return {
        "key": h.key, "file": final_name(h.key, h.suffix),
        **{k: h.info[k] for k in ("module_name", "module_type", "category", "hook_fn_name")},
        "records": h.stats.flushed, "bytes": int(old.get("bytes", 0)) + h.written_bytes,
        "dropped": int(old.get("dropped", 0)) + h.stats.dropped,
        "steps": steps, "fields": _fields_entry(h, old.get("fields", {})), "meta": h.info["meta"],
        "segments": len(h.sealed) if not h.final_done else 0,
    }


def _fields_entry(h: WriterHandle, old: dict[str, Any]) -> dict[str, Any]:
    """The ``fields`` of a handle's manifest entry: dtype, shape (None once ragged) and ndim."""
    fields = dict(old)
    for name, dn in list(h.field_dtype.items()):
        if name in h.shapes or name in h.ragged:
            shape = None if name in h.ragged else list(h.shapes[name])
            prev = fields.get(name)
            if prev is not None and prev.get("shape") != shape:
                shape = None
            fields[name] = {"dtype": dn, "shape": shape, "ndim": h.field_ndim.get(name)}
    return fields

