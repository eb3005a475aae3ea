"""The hookline on-disk format: names, version, chunk rule, manifest I/O (see docs/format.md).

A run directory holds one HDF5 file per hook handle plus ``manifest.json``. While a writer is
running, a handle's records live in *segment* files that are closed and renamed when complete;
at a clean ``close()`` they are merged into the handle's single ``<key>.h5`` file::

    <key>[.rank<r>].h5                               final file (complete, closed)
    <key>[.rank<r>].r<start:012d>-<end:012d>.h5seg   sealed segment: records [start, end)
    <key>[.rank<r>].r<start:012d>.h5seg.partial      segment being written (never read)
    <key>[.rank<r>].h5.partial                       final file being merged (never read)

Every complete file (``.h5`` and ``.h5seg``) has the same internal layout.
"""

from __future__ import annotations

import functools
import json
import math
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .errors import FormatError, InvalidArgumentError

__all__ = [
    "FORMAT_VERSION",
    "MAX_STEP",
    "FILE_FORMAT",
    "RUN_FORMAT",
    "INDEX_GROUP",
    "TARGET_CHUNK_BYTES",
    "hookline_version",
    "rank_suffix",
    "final_name",
    "segment_name",
    "partial_segment_name",
    "manifest_name",
    "chunk_records",
    "record_chunk",
    "flat_chunk",
    "index_chunk",
    "check_field_name",
    "read_manifest",
    "now_iso",
]

#: Version of the on-disk layout; readers refuse files with a larger version.
FORMAT_VERSION = 1
#: Value of the ``hookline_format`` root attribute of every handle file.
FILE_FORMAT = "hookline-handle"
#: Value of the manifest's ``format`` key.
RUN_FORMAT = "hookline-run"
#: Group holding per-field record index datasets.
INDEX_GROUP = "_index"
#: Target bytes per chunk (FACTS: 256 KiB - 4 MiB is fine, >= 16 MiB is bad).
TARGET_CHUNK_BYTES = 1 << 20
_MAX_CHUNK_RECORDS = 1 << 16
#: Records of this size range get exactly one chunk each.
RECORD_CHUNK_MIN = 1 << 20
RECORD_CHUNK_MAX = 4 << 20
#: Largest step or call number (both are stored as int64).
MAX_STEP = 2**63 - 1
_RESERVED = {"step", "call"}


@functools.lru_cache(maxsize=None)
def hookline_version() -> str:
    """The installed hookline version, ``"unknown"`` if not installed (looked up once: the
    metadata scan costs ~1.5 ms and every new file asks)."""
    try:
        from importlib.metadata import version

        return version("hookline")
    except Exception:  # pragma: no cover - source checkout without metadata
        return "unknown"


def now_iso() -> str:
    """The current UTC time as ISO 8601 with offset."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def rank_suffix(rank: int | None, world_size: int | None) -> str:
    """``".rank<r>"`` when ``world_size > 1``, else ``""`` (architecture.md file naming)."""
    if world_size is not None and world_size > 1:
        return f".rank{rank if rank is not None else 0}"
    return ""


def final_name(key: str, suffix: str = "") -> str:
    """Relative path of a handle's final file: ``<key><suffix>.h5``."""
    return f"{key}{suffix}.h5"


def segment_name(key: str, suffix: str, start: int, end: int) -> str:
    """Relative path of a sealed segment holding records ``[start, end)``."""
    return f"{key}{suffix}.r{start:012d}-{end:012d}.h5seg"


def partial_segment_name(key: str, suffix: str, start: int) -> str:
    """Relative path of a segment being written, starting at record ``start``."""
    return f"{key}{suffix}.r{start:012d}.h5seg.partial"


def merge_output_name(key: str, suffix: str, start: int, end: int) -> str:
    """Relative path of a merge output holding records ``[start, end)`` before it is published
    (renamed to :func:`segment_name`): one a crash leaves behind is a copy, not lost records."""
    return segment_name(key, suffix, start, end) + ".partial"


def manifest_name(rank: int | None, world_size: int | None) -> str:
    """``manifest.json``, or ``manifest.rank<r>.json`` when ``world_size > 1``."""
    return f"manifest{rank_suffix(rank, world_size)}.json"


#: File names of manifests (:func:`manifest_name`); use ``fullmatch``.
MANIFEST_RE = re.compile(r"manifest(?:\.rank(\d+))?\.json")


def run_identity(manifest: dict[str, Any]) -> str:
    """The run directory's identity: its ``run_uuid`` (runs written before it existed: their
    creation time), or ``""`` when unknown."""
    return str(manifest.get("run_uuid") or manifest.get("created") or "")


def check_field_name(name: Any) -> str:
    """Validate a field name: a non-empty str without ``/`` or NUL, not ``.``/``..`` (HDF5 path
    components), not ``step``/``call``, not starting with ``_``.

    Raises:
        InvalidArgumentError: with the offending name.
    """
    if (not isinstance(name, str) or not name or "/" in name or "\x00" in name or name in (".", "..")
            or name.startswith("_") or name in _RESERVED):
        raise InvalidArgumentError(
            f"invalid field name {name!r}: use a non-empty string without '/' or NUL, not '.' or '..', "
            f"not starting with '_' and not 'step'/'call' (e.g. 'outputs.0')"
        )
    return name


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def chunk_records(record_bytes: int, expected: int | None = None, target: int = TARGET_CHUNK_BYTES) -> int:
    """Records per chunk along axis 0: ``target // record_bytes`` (at least 1, at most 65536),
    capped at the next power of two >= ``expected`` so small files do not allocate big chunks."""
    c0 = max(1, min(_MAX_CHUNK_RECORDS, target // max(1, record_bytes)))
    if expected is not None:
        c0 = min(c0, _next_pow2(max(1, expected)))
    return c0


def record_chunk(shape: tuple[int, ...], itemsize: int, expected: int | None = None,
                 target: int = TARGET_CHUNK_BYTES) -> tuple[int, ...]:
    """Chunk shape of a fixed-shape field stored as ``(n, *shape)``.

    Rule: a record of 1 MiB - 4 MiB is one chunk (the writer hands it to HDF5 without
    copying; FACTS: chunks of 256 KiB - 4 MiB perform alike). Smaller records: whole records per
    chunk, ``chunk_records(record_bytes)`` of them (~1 MiB): each chunk write costs ~40-50 us of
    HDF5 bookkeeping plus a GIL hand-over, so fewer, bigger chunks beat saving the packing copy.
    A record larger than 4 MiB gets chunks of one record whose leading dimensions are halved
    (left to right) until the chunk is <= ``target`` bytes, so one record is a few contiguous
    chunks.
    """
    record_bytes = itemsize * math.prod(shape)
    if RECORD_CHUNK_MIN <= record_bytes <= RECORD_CHUNK_MAX:
        return (1, *shape)  # one chunk per record: written straight from the record, no copy
    if record_bytes <= target:
        return (chunk_records(record_bytes, expected, target), *shape)
    dims = list(shape)
    while itemsize * math.prod(dims) > target:
        for i, d in enumerate(dims):
            if d > 1:
                dims[i] = (d + 1) // 2
                break
        else:  # pragma: no cover - all dims 1 means record_bytes <= target
            break
    return (1, *dims)


def flat_chunk(itemsize: int, expected_elems: int | None = None, target: int = TARGET_CHUNK_BYTES) -> tuple[int]:
    """Chunk of a ragged field's flat 1-D data: ``target`` bytes (smaller for small files)."""
    n = max(1, target // itemsize)
    if expected_elems is not None:
        n = min(n, _next_pow2(max(1, expected_elems)))
    return (n,)


def index_chunk(expected: int, row: int | None = None) -> tuple[int, ...]:
    """Chunk of an index dataset (``step``, ``call``, ``record``, ``norm``, ``offset``: 1-D;
    ``shape``: 2-D with ``row`` columns)."""
    n = min(1 << 16, _next_pow2(max(1, expected)))
    return (n,) if row is None else (n, max(1, row))


def read_manifest(path: Path) -> dict[str, Any]:
    """Read and check one manifest file (:func:`check_manifest`).

    Raises:
        FormatError: not JSON, not a hookline manifest, a newer format version, or a value of the
            wrong type (the message names the key and the file).
    """
    try:
        obj = json.loads(Path(path).read_text("utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise FormatError(f"cannot read manifest {str(path)!r}: {e} (`hookline verify --repair` on the run "
                          "directory rebuilds it from the files)") from e
    check_manifest(obj, str(path))
    return obj


def _is_int(v: Any, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= MAX_STEP


def _field_entry(v: Any) -> bool:
    return isinstance(v, dict) and isinstance(v.get("dtype", ""), str) and _is_int(v.get("ndim", 0)) and (
        v.get("shape") is None or (isinstance(v["shape"], list) and all(_is_int(x) for x in v["shape"])))


#: Manifest values (docs/format.md section 2): key -> (check, what it must be). Absent keys are
#: fine (unknown keys are ignored); a present one of the wrong type makes the manifest invalid.
_STR = (lambda v: isinstance(v, str), "a string")
_COUNT = (_is_int, "a non-negative integer")
_OBJECT = (lambda v: v is None or isinstance(v, dict), "a JSON object")
_RUN_SCHEMA = {
    **dict.fromkeys(("hookline_version", "created", "updated", "verified", "run_uuid", "status"), _STR),
    "rank": (lambda v: v is None or _is_int(v), "a non-negative integer or null"),
    "world_size": (lambda v: v is None or _is_int(v, 1), "a positive integer or null"),
    "meta": _OBJECT,
    "dropped": _COUNT,
    "error": (lambda v: v is None or isinstance(v, str), "a string or null"),
}
_ENTRY_SCHEMA = {
    **dict.fromkeys(("file", "module_name", "module_type", "category", "hook_fn_name"), _STR),
    **dict.fromkeys(("records", "bytes", "dropped", "segments"), _COUNT),
    "steps": (lambda v: v is None or (isinstance(v, list) and len(v) == 2 and all(_is_int(x) for x in v)),
              "null or [first step, last step]"),
    "fields": (lambda v: isinstance(v, dict) and all(_field_entry(f) for f in v.values()),
               'an object of field name -> {"dtype": string, "shape": [integers] or null, "ndim": integer}'),
    "meta": _OBJECT,
    "lost": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
}


def check_manifest(obj: Any, where: str) -> None:
    """Raise :class:`FormatError` unless ``obj`` is a supported hookline manifest dict whose
    values have the types docs/format.md gives them (every handle entry a JSON object with a
    non-empty string ``key``)."""
    if not isinstance(obj, dict) or obj.get("format") != RUN_FORMAT:
        raise FormatError(f"{where!r} is not a hookline manifest (expected format={RUN_FORMAT!r})")
    v = obj.get("format_version")
    if not _is_int(v) or v > FORMAT_VERSION:
        raise FormatError(
            f"{where!r} has format_version {v!r:.60}; this hookline reads <= {FORMAT_VERSION}: upgrade hookline"
        )
    handles = obj.get("handles")
    if not isinstance(handles, dict):
        raise FormatError(f"{where!r} has no 'handles' object")
    _check_values(obj, _RUN_SCHEMA, "", where)
    for hid, entry in handles.items():
        if _plain_entry(entry):  # (the usual entry, checked in one pass; anything else in detail)
            continue
        at = f"handles[{hid!r}]"
        if not isinstance(entry, dict):
            _bad_value(where, at, entry, "a JSON object")
        key = entry.get("key")
        if not isinstance(key, str) or not key:
            _bad_value(where, f"{at}.key", key, "a non-empty string")
        _check_values(entry, _ENTRY_SCHEMA, f"{at}.", where)


_STR_KEYS = ("file", "module_name", "module_type", "category", "hook_fn_name")
_COUNT_KEYS = ("records", "bytes", "dropped", "segments")
_KNOWN = frozenset(("key", "steps", "fields", "meta", "lost", *_STR_KEYS, *_COUNT_KEYS))


def _plain_entry(e: Any) -> bool:
    """Whether a handle entry is what a writer writes, every value of its type (True: no detailed
    check needed; False says nothing: :func:`check_manifest` checks it key by key). One pass
    with no call per value: a manifest of 100,000 handles is checked in ~1 s less than key by key."""
    if type(e) is not dict or type(e.get("key")) is not str or not e["key"] or not _KNOWN.issuperset(e):
        return False
    for k in _STR_KEYS:
        if k in e and type(e[k]) is not str:
            return False
    for k in _COUNT_KEYS:
        v = e.get(k, 0)
        if type(v) is not int or not 0 <= v <= MAX_STEP:
            return False
    steps, meta, fields = e.get("steps"), e.get("meta"), e.get("fields", {})
    if steps is not None and not (type(steps) is list and len(steps) == 2 and type(steps[0]) is int
                                  and type(steps[1]) is int and 0 <= steps[0] <= MAX_STEP and 0 <= steps[1] <= MAX_STEP):
        return False
    if (meta is not None and type(meta) is not dict) or type(fields) is not dict or "lost" in e:
        return False
    for f in fields.values():
        if type(f) is not dict or type(f.get("dtype", "")) is not str:
            return False
        nd, shape = f.get("ndim", 0), f.get("shape")
        if type(nd) is not int or not 0 <= nd <= MAX_STEP:
            return False
        if shape is not None and (type(shape) is not list
                                  or not all(type(x) is int and 0 <= x <= MAX_STEP for x in shape)):
            return False
    return True


def _check_values(obj: dict[str, Any], schema: dict[str, Any], prefix: str, where: str) -> None:
    for k, (ok, what) in schema.items():
        if k in obj and not ok(obj[k]):
            _bad_value(where, prefix + k, obj[k], what)


def _bad_value(where: str, at: str, value: Any, what: str) -> None:
    raise FormatError(f"{where!r}: {at} is {value!r:.80} ({type(value).__name__}), expected {what}; correct "
                      f"it, or move the manifest aside (`hookline verify --repair` rebuilds it from the files)")
