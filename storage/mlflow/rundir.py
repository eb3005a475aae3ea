"""What a local run directory holds for an upload: its manifests and identity, sound handle files, file digests and norm series."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._h5read import open_part
from ..confine import RunRoot
from ..errors import DuplicateNameError, FormatError, UnknownNameError
from ..format import MANIFEST_RE, run_identity
from ..identity import foreign, missing_fields
from .keys import origin_tag
from .client import short_error

__all__ = ["NormSeries", "check_origin", "load_manifests", "created_ms", "file_damage", "file_digest", "norm_fields",
           "read_series", "part_series", "series_since"]

#: ``mode="stats"`` fields other than ``.norm`` get no metric series of their own.
_STATS_SUFFIXES = (".mean", ".std", ".min", ".max", ".absmax", ".hist")


def load_manifests(run_dir: Path, rank: int | None) -> list[tuple[Path, dict]]:
    """``(path, manifest)`` of every manifest of ``run_dir`` (only ``rank``'s, else the unranked
    one, when ``rank`` is given), in name order.

    Raises:
        UnknownNameError: ``run_dir`` does not exist.
        FormatError: no manifest, or one that is not a JSON object with a ``handles`` mapping.
    """
    if not run_dir.is_dir():
        raise UnknownNameError(
            f"run directory {str(run_dir)!r} does not exist: pass the directory a Recorder/RunWriter wrote"
        )
    found = sorted(p for p in run_dir.iterdir() if MANIFEST_RE.fullmatch(p.name))
    if rank is not None:
        ranked = [p for p in found if p.name == f"manifest.rank{int(rank)}.json"]
        found = ranked or [p for p in found if p.name == "manifest.json"]
    if not found:
        raise FormatError(
            f"{str(run_dir)!r} has no manifest.json: it is not a hookline run directory "
            "(run `hookline verify` on it, or pass the directory a Recorder wrote)"
        )
    out = []
    root = RunRoot(run_dir)
    for p in found:
        root.file(p.name, what="manifest")  # (a FIFO would block the read; a symlink may lead out)
        try:
            man = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise FormatError(f"manifest {str(p)!r} is not readable JSON ({e}); run `hookline verify` on the run") from e
        if not isinstance(man, dict) or not isinstance(man.get("handles", {}), dict):
            raise FormatError(f"manifest {str(p)!r} has no 'handles' mapping; run `hookline verify` on the run")
        out.append((p, man))
    return out


def created_ms(man: dict) -> int:
    """The manifest's creation time in ms since the epoch (0 when unknown): the base of the
    deterministic metric timestamps."""
    created = man.get("created")
    if isinstance(created, str):
        try:
            return int(_dt.datetime.fromisoformat(created).timestamp() * 1000)
        except ValueError:
            pass
    return 0


def file_damage(path: Path, handle_id: str, entry: dict, exact: bool,
                norms: tuple[list[tuple[str, str, bool]], int, dict] | None = None,
                manifest: dict | None = None) -> str | None:
    """Why a handle file must not be uploaded, or None when it is sound.

    A file is damaged when it does not open as a hookline handle file (truncated, not HDF5),
    belongs to another handle or another run (:func:`~hookline.storage.identity.foreign`), its
    index does not hold its records, a field's index or last entry does not read, it has a field
    the manifest entry does not list, or (``exact``: the final pass of a closed run) its record
    count is not the manifest's or it lacks a field the manifest lists.

    Args:
        path: the handle file (already confined to the run directory).
        handle_id: the handle the manifest entry is of.
        entry: the manifest entry.
        exact: also require the manifest's record count (mid-run passes may read an older manifest).
        norms: ``(fields, start, out)``: for a sound file that holds all of the handle's records
            (``exact``), also put its :func:`part_series` of ``fields`` from record ``start`` on
            into ``out["series"]`` (the file is opened once for both).
        manifest: the manifest the entry is of (its ``run_uuid`` and ``status``).
    """
    try:
        part = open_part(path)
    except Exception as e:  # noqa: BLE001 - whatever keeps it from opening is damage
        return f"it does not open as a hookline file: {short_error(e)}"
    try:
        why = foreign(part.attrs, handle_id, (manifest or {}).get("run_uuid"))
        if why is not None:
            return why
        claimed = entry.get("records")
        if exact and isinstance(claimed, int) and (part.n != claimed or part.record_start != 0):
            return f"it holds records [{part.record_start}, {part.record_start + part.n}), the manifest says {claimed}"
        listed = entry.get("fields") if isinstance(entry.get("fields"), dict) else {}
        unknown = sorted(set(part.field_names) - set(listed))
        if unknown:
            return f"its fields {unknown} are not in the manifest"
        gone = missing_fields(manifest or {}, entry, part.field_names) if exact else []
        if gone:
            return f"it lacks the fields {gone} the manifest lists"
        if len(part.steps) != part.n or len(part.calls) != part.n:
            return "its step/call index does not hold its records"
        for name in part.field_names:
            pf = part.field(name)
            if pf.count > part.n or len(pf.records) != pf.count:
                return f"field {name!r}: its index does not match its {pf.count} entries"
            if pf.count:
                pf.read_stored(pf.count - 1)  # the data is there
        if norms is not None and exact:
            fields, start, out = norms
            out["series"] = part_series(part, fields, start)
    except Exception as e:  # noqa: BLE001 - any failure to read it is damage
        return short_error(e)
    finally:
        part.close()
    return None


def file_digest(path: Path, cache: dict[Path, tuple[tuple[int, int], str]]) -> str:
    """``"<size>:<sha256>"`` of a file, memoised in ``cache`` on (size, mtime_ns)."""
    st = path.stat()
    sig = (st.st_size, st.st_mtime_ns)
    hit = cache.get(path)
    if hit is not None and hit[0] == sig:
        return hit[1]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    digest = f"{st.st_size}:{h.hexdigest()}"
    cache[path] = (sig, digest)
    return digest


def norm_fields(fields: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """``(field, metric_base, already_a_norm)`` for the fields that get a norm series.

    ``fields`` is a manifest handle entry's ``fields`` (name -> ``{"shape": ...}``). A stats-mode
    norm is a scalar per record named ``<field>.norm``; a tensor field that merely has that name
    (a module returning ``{"norm": tensor}``) gets its own L2 norm like any other.
    """

    def stats_norm(name: str) -> bool:
        info = fields.get(name)
        return name.endswith(".norm") and isinstance(info, dict) and info.get("shape") == []

    out = []
    for f in fields:
        if stats_norm(f):  # mode="stats": the field *is* the per-record L2 norm
            out.append((f, f[: -len(".norm")], True))
        elif f.endswith(_STATS_SUFFIXES) and stats_norm(f.rsplit(".", 1)[0] + ".norm"):
            continue  # other summaries of a stats-mode field
        else:
            out.append((f, f, False))
    return out


@dataclass
class NormSeries:
    """The norms of one field: every entry, and the new ones (handle record index >= the watermark).

    Attributes:
        base: metric base name (the field name, without ``.norm`` for stats-mode fields).
        records: handle record index of each new entry (-> deterministic timestamps).
        steps: training step of each new entry.
        norms: L2 norm of each new entry.
        all_norms: every entry's norm (for the summaries).
        all_steps: every entry's step.
        all_records: every entry's handle record index.
    """

    base: str
    records: np.ndarray
    steps: np.ndarray
    norms: np.ndarray
    all_norms: np.ndarray
    all_steps: np.ndarray
    all_records: np.ndarray


def read_series(run: Any, handle_id: str, rank: int | None, fields: list[tuple[str, str, bool]],
                start: int) -> tuple[int, list[NormSeries]]:
    """Handle record count and the per-field norm series of records ``start:``.

    Args:
        run: the run directory opened with the storage reader.
        handle_id: the handle.
        rank: the manifest's rank (None: unranked).
        fields: :func:`norm_fields` of the handle.
        start: the watermark: records already logged.
    """
    h = run.handle(handle_id, rank=rank) if rank is not None else run.handle(handle_id)
    n = len(h)
    out = []
    present = set(h.fields)
    for name, base, is_norm in fields:
        if name not in present:
            continue
        fld = h[name]
        recs = np.asarray(fld.records, dtype=np.int64)
        if is_norm:  # mode="stats": the stored value is the norm
            vals = np.abs(np.asarray(fld.read(), dtype=np.float64).reshape(len(fld), -1)[:, 0]) if len(fld) \
                else np.zeros(0)
        else:
            vals = np.asarray(fld.norms(), dtype=np.float64)
        steps = np.asarray(fld.steps, dtype=np.int64)
        new = recs >= start
        out.append(NormSeries(base, recs[new], steps[new], vals[new], vals, steps, recs))
    return n, out


def part_series(part: Any, fields: list[tuple[str, str, bool]], start: int) -> list[NormSeries]:
    """:func:`read_series` of a handle whose records are all in one opened part (its final file).

    Args:
        part: the opened part (:func:`~.._h5read.open_part`).
        fields: :func:`norm_fields` of the handle.
        start: the watermark: records already logged.
    """
    out = []
    present = set(part.field_names)
    steps_all = np.asarray(part.steps, dtype=np.int64)
    for name, base, is_norm in fields:
        if name not in present:
            continue
        pf = part.field(name)
        recs = np.asarray(pf.records, dtype=np.int64)

        def value(j: int, pf: Any = pf) -> np.ndarray:
            return np.asarray(pf.read_stored(j), dtype=np.float64).ravel()

        if is_norm:  # mode="stats": the stored value is the norm
            vals = np.array([abs(float(value(j)[0])) for j in range(pf.count)], dtype=np.float64)
        elif pf.stored_norms is not None:
            vals = np.asarray(pf.stored_norms, dtype=np.float64)
        else:  # (int/bool fields: no stored norms)
            vals = np.array([float(np.linalg.norm(value(j))) for j in range(pf.count)], dtype=np.float64)
        steps = steps_all[recs - part.record_start]
        new = recs >= start
        out.append(NormSeries(base, recs[new], steps[new], vals[new], vals, steps, recs))
    return out


def series_since(series: list[NormSeries], start: int) -> list[NormSeries]:
    """``series`` with only the entries of handle records ``start:`` as new (the summaries keep
    every entry): series read from an earlier watermark, brought up to the run's."""
    out = []
    for s in series:
        new = s.all_records >= start
        out.append(NormSeries(s.base, s.all_records[new], s.all_steps[new], s.all_norms[new], s.all_norms,
                              s.all_steps, s.all_records))
    return out


def check_origin(run_id: str, run_dir: Path, manifests: list[tuple[Path, dict]],
                 tags_now: dict[str, str], params_now: dict[str, str]) -> dict[str, str]:
    """The run's ``hookline.origin`` params (each rank's run directory, by its manifest's
    ``run_uuid``; a param, since it never changes; runs synced before were tagged instead).

    Raises:
        DuplicateNameError: the MLflow run already holds another run directory: its handle files
            have the same artifact paths and its records the same metric keys, so this one would
            replace the first one's files and lose its metric points.
    """
    tags = {}
    for _, man in manifests:
        key = origin_tag(man.get("rank"))
        mine = run_identity(man)
        if not mine:
            continue  # identity unknown (a manifest rebuilt from old files): neither checked nor set
        have = params_now.get(key, tags_now.get(key))
        if have is not None and have != mine:
            raise DuplicateNameError(
                f"MLflow run {run_id!r} already holds the hookline data of another run directory "
                f"({key} {have!r}; {str(run_dir)!r} is {mine!r}): one run directory per MLflow run; "
                "record or sync this one into a new MLflow run (e.g. a child run of this one)"
            )
        tags[key] = mine
    return tags
