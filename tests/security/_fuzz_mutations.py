"""Seeded mutations of a run directory for ``test_fuzz.py``: the plan (one test id per variant) and
how each variant is applied to a copy of a base run.

Two base runs are mutated (``_fuzz_runs.py`` records them): ``rec``, a closed run recorded by the
real :class:`~hookline.tracker.Recorder` (one final ``.h5`` per handle, ragged and fixed fields),
and ``seg``, a run closed with ``merge_on_close=False`` (several sealed segments per handle).
Their structure is fixed (the names below), so the plan is known at collection time; every random
choice (offsets, bits, lengths, manifest paths and values) comes from ``random.Random(seed)`` of
the variant, so a failing id reproduces.

How an HDF5 mutation changed the file is decided by plain h5py (the ground truth, independent of
hookline): :func:`h5_change` reads every object, attribute and dataset value of the base file and
of the mutated one. A change only in the *values* of value datasets (a field's data, ``step``,
``call``, ``_index/<F>/norm``) cannot be detected by any reader: neither HDF5's default file
format nor hookline's format 1 checksums raw data. Such a handle may read back changed values;
everything else a mutation changes (attributes, types, shapes, chunk layout, the ``record``,
``offset`` and ``shape`` indexes, unreadable objects) must be reported or read back correctly.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from _fuzz_bounds import in_child  # (h5py itself crashes on a few damaged files)

REC_HANDLES: dict[str, tuple[str, list[str]]] = {  # handle id -> (key, fields)
    "outputs[fc1]": ("outputs/fc1", ["outputs.0"]),       # ragged
    "outputs[head]": ("outputs/head", ["outputs.0"]),     # fixed
    "grads[fc1]": ("grads/fc1", ["grad_out.0"]),          # ragged
    "grads[head]": ("grads/head", ["grad_in.0", "grad_out.0"]),  # fixed, two fields
}
SEG_HANDLES: dict[str, tuple[str, list[str]]] = {
    "outputs[a]": ("outputs/a", ["outputs.0", "outputs.1"]),
    "grads[a]": ("grads/a", ["grad_out.0"]),
}
SEG_FILES = [
    "outputs/a.r000000000000-000000000001.h5seg", "outputs/a.r000000000001-000000000004.h5seg",
    "outputs/a.r000000000004-000000000008.h5seg", "outputs/a.r000000000008-000000000012.h5seg",
    "grads/a.r000000000000-000000000002.h5seg", "grads/a.r000000000002-000000000004.h5seg",
    "grads/a.r000000000004-000000000008.h5seg", "grads/a.r000000000008-000000000012.h5seg",
]
HANDLES = {"rec": REC_HANDLES, "seg": SEG_HANDLES}
FILES = {"rec": [k + ".h5" for k, _ in REC_HANDLES.values()], "seg": SEG_FILES}

_TOP_KEYS = ["format", "format_version", "status", "rank", "world_size", "meta", "dropped", "error",
             "created", "run_uuid", "handles"]
_ENTRY_KEYS = ["key", "file", "module_name", "module_type", "category", "hook_fn_name", "records",
               "bytes", "dropped", "steps", "fields", "meta", "segments"]
_FIELD_KEYS = ["dtype", "shape", "ndim"]
_NUMERIC_ENTRY = ["records", "bytes", "dropped", ("steps", 0), ("steps", 1), "segments"]
_TYPE_VALUES: list[Any] = [None, True, "x", 1.5, -1, [], {}, [1, 2], {"a": 1}, 0]
_NUMBERS: list[Any] = [-1, -(2 ** 63), 2 ** 63, 2 ** 64 + 1, 10 ** 30, 1e308, 3.5, float("nan"), float("inf")]
_CTRL_VALUES = ["\x1b[31mEVIL\x1b[0m", "a\x00b", "x\ny", "\x07\x08", "\u202eRTL", "A" * 5000,
                "\x9b31m", "\x1b]0;title\x07"]
#: ``file``/``key`` values leading out of the run; ``{ws}`` is the directory holding the run and
#: its sentinel, ``{file}``/``{key}`` the handle's own file and key.
_PATHS = [
    ("file", "{ws}/sentinel/{file}"), ("file", "../sentinel/{file}"), ("file", "{ws}/elsewhere/x.h5"),
    ("file", "../elsewhere/x.h5"), ("file", "/etc/passwd"), ("file", "outputs/../../sentinel/{file}"),
    ("file", ""), ("file", "."), ("file", "outputs"),
    ("key", "{ws}/sentinel/{key}"), ("key", "../sentinel/{key}"), ("key", "{ws}/elsewhere/k"),
    ("key", "../elsewhere/k"), ("key", ""), ("key", ".."), ("key", "outputs/../../sentinel/{key}"),
]


@dataclass(frozen=True)
class Variant:
    """One mutation of one base run.

    Attributes:
        base: ``"rec"`` or ``"seg"``.
        kind: the mutation (``h5-meta-flip``, ``json-path``, ``fifo``, ...).
        target: the file it mutates (relative to the run), or the manifest path it changes.
        seed: seed of its ``random.Random``.
        arg: a choice made when planning (a value, a path template), part of the id.
    """

    base: str
    kind: str
    target: str
    seed: int
    arg: str = ""

    @property
    def id(self) -> str:
        parts = [self.base, self.kind, f"s{self.seed:02d}", self.target.replace("/", "_")]
        if self.arg:
            parts.append(self.arg)
        return "-".join(p for p in parts if p)

    @property
    def handle(self) -> str | None:
        """The handle whose file the variant mutates (None for manifest and run-level mutations)."""
        for hid, (key, _) in HANDLES[self.base].items():
            if self.target == key + ".h5" or self.target.startswith(key + ".r"):
                return hid
        return None


@dataclass
class Applied:
    """What applying a variant did.

    Attributes:
        note: the concrete change (offsets, bits, lengths, values), for failure messages.
        values_only: handles whose file changed only in values of value datasets (undetectable).
        fifos: FIFOs the variant created (to unblock a reader stuck on one).
    """

    note: str = ""
    values_only: set[str] = field(default_factory=set)
    fifos: list[Path] = field(default_factory=list)


# ------------------------------------------------------------------------------------------ plan
def _json_paths(base: str) -> list[tuple]:
    """Every manifest path the JSON mutations may pick (top-level keys, entry keys, field keys)."""
    out: list[tuple] = [(k,) for k in _TOP_KEYS]
    for hid, (_, fields) in HANDLES[base].items():
        out += [("handles", hid, k) for k in _ENTRY_KEYS]
        for f in fields:
            out += [("handles", hid, "fields", f, k) for k in _FIELD_KEYS]
    return out


def _numeric_paths(base: str) -> list[tuple]:
    out: list[tuple] = [("format_version",), ("dropped",)]
    for hid, (_, fields) in HANDLES[base].items():
        out += [("handles", hid, *(k if isinstance(k, tuple) else (k,))) for k in _NUMERIC_ENTRY]
        out += [("handles", hid, "fields", f, "ndim") for f in fields]
    return out


def _path_text(path: tuple) -> str:
    parts = [str(p) for p in path if p != "handles" and p != "fields"]
    return ".".join(p.replace("[", "_").replace("]", "") for p in parts)


def _json_variants(base: str, kind: str, n: int) -> list[Variant]:
    out = []
    for seed in range(n):
        rng = random.Random(f"{base}-{kind}-{seed}")
        if kind == "json-type":
            path, val = rng.choice(_json_paths(base)), rng.randrange(len(_TYPE_VALUES))
            out.append(Variant(base, kind, _path_text(path), seed, f"v{val}"))
        elif kind == "json-num":
            path, val = rng.choice(_numeric_paths(base)), rng.randrange(len(_NUMBERS))
            out.append(Variant(base, kind, _path_text(path), seed, f"v{val}"))
        elif kind == "json-del":
            out.append(Variant(base, kind, _path_text(rng.choice(_json_paths(base))), seed))
        elif kind == "json-path":
            hid = rng.choice(sorted(HANDLES[base]))
            out.append(Variant(base, kind, _path_text(("handles", hid)), seed, f"p{seed % len(_PATHS)}"))
        elif kind == "json-ctrl":
            out.append(Variant(base, kind, "manifest.json", seed, f"v{seed % len(_CTRL_VALUES)}"))
        else:  # json-flip, json-trunc: offsets chosen when applied
            out.append(Variant(base, kind, "manifest.json", seed))
    return out


def plan() -> list[Variant]:
    """Every variant of the fuzz suite (about 290), in a stable order."""
    v: list[Variant] = [Variant("rec", "none", "", 0), Variant("seg", "none", "", 0)]
    for f in FILES["rec"]:
        v += [Variant("rec", "h5-meta-flip", f, s) for s in range(14)]
        v += [Variant("rec", "h5-head-flip", f, s) for s in range(6)]
        v += [Variant("rec", "h5-data-flip", f, s) for s in range(8)]
        v += [Variant("rec", "h5-multi-flip", f, s) for s in range(3)]
        v += [Variant("rec", "h5-trunc", f, s) for s in range(6)]
    for kind, n in (("json-type", 14), ("json-num", 14), ("json-path", 16), ("json-del", 10),
                    ("json-flip", 10), ("json-trunc", 6), ("json-ctrl", 8)):
        v += _json_variants("rec", kind, n)
    for i, f in enumerate(FILES["rec"]):
        v += [Variant("rec", "symlink-out", f, 0), Variant("rec", "fifo", f, 0)]
    v += [Variant("rec", "symlink-dir", "outputs", 0), Variant("rec", "symlink-in", "outputs/fc1.h5", 0),
          Variant("rec", "devzero", "outputs/head.h5", 0), Variant("rec", "dir", "grads/fc1.h5", 0),
          Variant("rec", "dir", "manifest.json", 0), Variant("rec", "fifo", "manifest.json", 0),
          Variant("rec", "delete", "outputs/head.h5", 0)]
    for f in FILES["seg"]:
        v += [Variant("seg", "h5-meta-flip", f, s) for s in range(3)]
        v += [Variant("seg", "h5-data-flip", f, 0), Variant("seg", "h5-trunc", f, 0), Variant("seg", "h5-trunc", f, 1)]
    v += [Variant("seg", "delete", SEG_FILES[1], 0), Variant("seg", "delete", SEG_FILES[6], 0),
          Variant("seg", "symlink-out", SEG_FILES[2], 0), Variant("seg", "fifo", SEG_FILES[5], 0)]
    v += _json_variants("seg", "json-path", 2)
    return v


#: Variants also synced to the MLflow server fixture (a sync costs ~1 s; the others take ms).
#: Only ``rec``: ``sync`` uploads final files, and ``seg`` has none (its sync fails by design).
SYNC_IDS = [
    "rec-none-s00",
    "rec-h5-trunc-s00-outputs_head.h5", "rec-h5-trunc-s01-grads_fc1.h5",
    "rec-h5-meta-flip-s00-outputs_fc1.h5", "rec-h5-meta-flip-s00-outputs_head.h5",
    "rec-h5-meta-flip-s00-grads_fc1.h5", "rec-h5-meta-flip-s00-grads_head.h5",
    "rec-h5-head-flip-s00-outputs_head.h5", "rec-h5-head-flip-s01-grads_fc1.h5",
    "rec-h5-data-flip-s00-grads_head.h5",
    "rec-symlink-out-s00-outputs_fc1.h5", "rec-symlink-out-s00-grads_head.h5",
    "rec-symlink-dir-s00-outputs", "rec-delete-s00-outputs_head.h5", "rec-fifo-s00-grads_fc1.h5",
    "rec-json-trunc-s00-manifest.json", "rec-json-flip-s00-manifest.json", "rec-devzero-s00-outputs_head.h5",
    "rec-json-path-s10-grads_fc1-p10",
]


def sync_plan(variants: list[Variant]) -> list[Variant]:
    """The variants synced to MLflow: :data:`SYNC_IDS` plus every ``json-path`` variant of ``file``
    and two ``json-type``/``json-ctrl`` ones (about 30)."""
    picked = [v for v in variants if v.id in SYNC_IDS]
    picked += [v for v in variants if v.kind == "json-path" and v.base == "rec" and v.arg
               and _PATHS[int(v.arg[1:])][0] == "file" and int(v.arg[1:]) < 6]
    picked += [v for v in variants if v.kind in ("json-type", "json-ctrl") and v.seed < 2 and v.base == "rec"]
    return picked


# ------------------------------------------------------------------------------------ HDF5 ground truth
#: Above this many bytes an object is not read for the ground truth (a mutated size): "changed".
_MAX_READ = 64 << 20


def storage_ranges(path: Path) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(live, stored)`` byte ranges of a well-formed handle file's raw data: ``stored`` every
    chunk (or contiguous block), ``live`` the part of it that holds entries (chunks are padded
    past the last entry)."""
    live, stored = [], []

    def visit(_: str, obj: Any) -> None:
        if not isinstance(obj, h5py.Dataset) or obj.id.get_storage_size() == 0:
            return
        row = int(np.prod(obj.shape[1:], dtype=np.int64)) * obj.dtype.itemsize
        if obj.chunks is None:
            off = obj.id.get_offset()
            stored.append((off, off + obj.id.get_storage_size()))
            live.append((off, off + obj.shape[0] * row))
            return
        for i in range(obj.id.get_num_chunks()):
            info = obj.id.get_chunk_info(i)
            stored.append((info.byte_offset, info.byte_offset + info.size))
            start = info.chunk_offset[0]
            rows = max(0, min(obj.shape[0], start + obj.chunks[0]) - start)
            live.append((info.byte_offset, info.byte_offset + min(info.size, rows * row)))

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return sorted(live), sorted(stored)


def _outside(size: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The complement of ``ranges`` in ``[0, size)``."""
    out, cur = [], 0
    for a, b in sorted(ranges):
        if a > cur:
            out.append((cur, a))
        cur = max(cur, b)
    if cur < size:
        out.append((cur, size))
    return out


def _pick_offset(rng: random.Random, ranges: list[tuple[int, int]]) -> int:
    """A byte offset drawn uniformly from the union of ``ranges``."""
    total = sum(b - a for a, b in ranges)
    k = rng.randrange(total)
    for a, b in ranges:
        if k < b - a:
            return a + k
        k -= b - a
    raise AssertionError("unreachable")


def _attrs(obj: Any) -> dict[str, Any]:
    out = {}
    for name in obj.attrs:
        aid = h5py.h5a.open(obj.id, name.encode())
        if int(np.prod(aid.shape or (), dtype=np.int64)) * aid.dtype.itemsize > _MAX_READ:
            out[name] = ("too large", aid.shape)
            continue
        v = obj.attrs[name]
        out[name] = v.tolist() if isinstance(v, np.ndarray) else v
    return out


def h5_content(path: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    """``(structure, values)`` of an HDF5 file as plain h5py reads it: ``structure`` maps every
    object to its kind, attributes, dtype, shape, chunks and filters (and the index datasets to
    their bytes), ``values`` the value datasets to their bytes. Raises whatever h5py raises."""
    structure: dict[str, Any] = {}
    values: dict[str, bytes] = {}

    def visit(name: str, obj: Any) -> None:
        if not isinstance(obj, h5py.Dataset):
            structure[name] = ("group", _attrs(obj))
            return
        dcpl = obj.id.get_create_plist()
        structure[name] = ("dataset", _attrs(obj), obj.dtype.str, obj.shape, obj.chunks, dcpl.get_nfilters(),
                           dcpl.get_external_count(), obj.is_virtual)
        if obj.size * obj.dtype.itemsize > _MAX_READ:
            structure[name] += ("too large",)
            return
        data = obj[()]
        data = data.tobytes() if isinstance(data, np.ndarray) else repr(data).encode()
        base = name.rsplit("/", 1)[-1]
        if "/" not in name or (name.startswith("_index/") and base == "norm"):
            values[name] = data  # a field, step, call, or a norm index: raw values
        else:
            structure[name] += (data,)  # record/offset/shape: they locate the values

    with h5py.File(path, "r") as f:
        structure["/"] = ("group", _attrs(f))
        f.visititems(visit)
    return structure, values


def h5_change(original: tuple[dict, dict], path: Path) -> str:
    """How the file at ``path`` differs from ``original`` (:func:`h5_content` of the base file):
    ``"same"``, ``"values"`` (only raw values of value datasets) or ``"structure"``."""
    try:
        structure, values = h5_content(path)
    except Exception:  # (h5py cannot read it: whatever hookline makes of it must be reported)
        return "structure"
    if structure != original[0] or values.keys() != original[1].keys():
        return "structure"
    return "same" if values == original[1] else "values"


# ------------------------------------------------------------------------------------------ applying
def _flip(path: Path, offsets: list[int], rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    done = []
    for off in offsets:
        bit = rng.randrange(8)
        data[off] ^= 1 << bit
        done.append(f"{off}:{bit}")
    path.write_bytes(bytes(data))
    return "flipped byte:bit " + ",".join(done)


def _apply_h5(v: Variant, run: Path, base: Path, ground: dict[Path, tuple[dict, dict]]) -> Applied:
    """Bit flips in a region of a handle file, or a truncation; the ground truth classifies it."""
    rng = random.Random(f"{v.id}")
    path = run / v.target
    size = path.stat().st_size
    live, stored = storage_ranges(base / v.target)
    meta = _outside(size, stored)
    if v.kind == "h5-trunc":
        n = size - rng.randint(1, 4096) if v.seed % 3 == 2 else rng.randrange(size)
        with open(path, "r+b") as fh:
            fh.truncate(max(0, n))
        note = f"truncated {size} -> {max(0, n)} bytes"
    elif v.kind == "h5-data-flip":
        note = _flip(path, [_pick_offset(rng, live)], rng)
    elif v.kind == "h5-head-flip":
        head = _outside(size, stored + [(2048, size)])
        note = _flip(path, [_pick_offset(rng, head)], rng)
    elif v.kind == "h5-multi-flip":
        note = _flip(path, [_pick_offset(rng, meta) for _ in range(8)], rng)
    else:  # h5-meta-flip: a byte in use (most zero bytes of the metadata region are free space)
        data = path.read_bytes()
        used = [(i, i + 1) for a, b in meta for i in range(a, b) if data[i]]
        note = _flip(path, [_pick_offset(rng, used)], rng)
    key = (base / v.target).resolve()
    if key not in ground:
        ground[key] = h5_content(base / v.target)
    change, why = in_child(lambda: h5_change(ground[key], path), timeout=60)
    if why is not None:
        change = f"structure; h5py reading it: {why}"
    out = Applied(note=f"{v.target}: {note} (h5py sees: {change})")
    if change == "values":
        out.values_only.add(v.handle or "")
    return out


def _get_parent(doc: Any, path: tuple) -> tuple[Any, Any]:
    """The container holding ``path``'s last element, and that element's key."""
    cur = doc
    for p in path[:-1]:
        cur = cur[p]
    return cur, path[-1]


def _parse_path(base: str, text: str) -> tuple:
    """The manifest path a :func:`_path_text` text stands for (the plan names paths by text)."""
    for path in _json_paths(base) + _numeric_paths(base) + [("handles", h) for h in HANDLES[base]]:
        if _path_text(path) == text:
            return path
    raise AssertionError(f"unknown manifest path {text!r}")


def _apply_json(v: Variant, run: Path, ws: Path) -> Applied:
    """A JSON-level mutation of ``manifest.json``: a value of the wrong type, a bad number, a
    deleted key, a path out of the run, control characters, or flipped/truncated bytes."""
    mpath = run / "manifest.json"
    rng = random.Random(v.id)
    if v.kind in ("json-flip", "json-trunc"):
        size = mpath.stat().st_size
        if v.kind == "json-trunc":
            n = rng.randrange(size)
            mpath.write_bytes(mpath.read_bytes()[:n])
            return Applied(note=f"manifest truncated {size} -> {n} bytes")
        return Applied(note="manifest " + _flip(mpath, [rng.randrange(size) for _ in range(1 + v.seed % 3)], rng))
    doc = json.loads(mpath.read_text())
    if v.kind == "json-ctrl":
        note = _apply_ctrl(doc, v, rng)
    elif v.kind == "json-path":
        which, template = _PATHS[int(v.arg[1:])]
        hid = _parse_path(v.base, v.target)[1]
        entry = doc["handles"][hid]
        value = template.format(ws=ws, file=entry["file"], key=entry["key"])
        entry[which] = value
        note = f"handles[{hid!r}][{which!r}] = {value!r}"
    else:
        path = _parse_path(v.base, v.target)
        parent, last = _get_parent(doc, path)
        assert last in parent or isinstance(parent, list), f"{path} not in the base manifest"
        if v.kind == "json-del":
            del parent[last]
            note = f"deleted {path}"
        else:
            pool = _TYPE_VALUES if v.kind == "json-type" else _NUMBERS
            value = pool[int(v.arg[1:])]
            if v.kind == "json-type" and type(value) is type(parent[last]):  # (a different type)
                value = pool[(int(v.arg[1:]) + 1) % len(pool)]
            parent[last] = value
            note = f"{path} = {value!r}"
    mpath.write_text(json.dumps(doc, indent=1))
    return Applied(note=note)


def _apply_ctrl(doc: dict, v: Variant, rng: random.Random) -> str:
    """Control characters (or a very long string) in an id, a module name or a field name."""
    value = _CTRL_VALUES[int(v.arg[1:])]
    hid = rng.choice(sorted(HANDLES[v.base]))
    where = rng.choice(["module_name", "module_type", "category", "hook_fn_name", "handle id", "field name"])
    if where == "handle id":
        doc["handles"] = {(hid + value if h == hid else h): e for h, e in doc["handles"].items()}
    elif where == "field name":
        fields = doc["handles"][hid]["fields"]
        name = next(iter(fields))
        fields[name + value] = fields.pop(name)
    else:
        doc["handles"][hid][where] = value
    return f"{where} of {hid!r} gets {value[:40]!r}"


def _replace(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _apply_struct(v: Variant, run: Path, sentinel: Path) -> Applied:
    """A handle file (or the manifest) replaced by a symlink out of the run, a FIFO, a directory,
    /dev/zero, a symlink to another handle's file, or deleted."""
    path = run / v.target
    _replace(path)
    out = Applied(note=f"{v.target}: {v.kind}")
    if v.kind in ("symlink-out", "symlink-dir"):
        path.symlink_to(sentinel / v.target)  # the sentinel run has the same names, other values
    elif v.kind == "symlink-in":
        path.symlink_to(os.path.relpath(run / "grads/fc1.h5", path.parent))
    elif v.kind == "devzero":
        path.symlink_to("/dev/zero")
    elif v.kind == "fifo":
        os.mkfifo(path)
        out.fifos.append(path)
    elif v.kind == "dir":
        path.mkdir()
        (path / "x.h5").write_bytes(b"\x89HDF\r\n\x1a\n")
    else:
        assert v.kind == "delete", v.kind
    return out


def apply(v: Variant, run: Path, sentinel: Path, base: Path, ground: dict[Path, tuple[dict, dict]]) -> Applied:
    """Apply ``v`` to ``run`` (a copy of ``base``; ``sentinel`` is the sibling directory that must
    stay untouched). ``ground`` caches :func:`h5_content` of base files."""
    if v.kind == "none":
        return Applied(note="unchanged")
    if v.kind.startswith("h5-"):
        return _apply_h5(v, run, base, ground)
    if v.kind.startswith("json-"):
        return _apply_json(v, run, run.parent)
    return _apply_struct(v, run, sentinel)
