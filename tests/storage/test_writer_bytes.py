"""A handle file written by HandleFileWriter (h5py's low-level API) is byte-identical to the same
file written with h5py's high-level API as docs/format.md describes it: the low-level writing
changes no byte readers see."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import xxhash
import pytest

from hookline.storage import dtypes
from hookline.storage._filters import compression_kwargs
from hookline.storage._h5check import check_structure, same_structure
from hookline.storage._h5write import FieldSpec, HandleFileWriter
from hookline.storage.format import FILE_FORMAT, FORMAT_VERSION, INDEX_GROUP, flat_chunk, index_chunk, record_chunk

ATTRS = {"handle_id": "outputs[blocks.0]", "key": "outputs/blocks.0", "module_name": "blocks.0",
         "module_type": "Linear", "category": "forward_hook", "hook_fn_name": "outputs",
         "rank": np.int64(-1), "world_size": np.int64(-1), "hookline_version": "0.0",
         "meta": json.dumps({"é": 1}), "run_meta": "{}", "created": "2026-01-01T00:00:00+00:00",
         "run_uuid": "a" * 32, "run_created": "2026-01-01T00:00:00+00:00"}

#: (name, dtype name, ragged, per-record shape, compression, records): fixed and ragged fields,
#: a non-ASCII name, bool, complex, bits-stored dtypes, a compressed and a checksummed field,
#: records larger than a chunk (cut along their first axis, or one index of the leading axes at a time).
FIELDS = [
    ("outputs.0", "float32", False, (16, 64), None, 11),
    ("grad_out.0", "float32", True, (3, 5), None, 4),
    ("outputs.größe", "bfloat16", False, (7,), None, 3),
    ("outputs.mask", "bool", False, (5,), None, 2),
    ("outputs.z", "complex64", False, (2,), None, 2),
    ("outputs.g", "float16", False, (4, 4), "gzip+checksum", 6),
    # records larger than a chunk (8 MiB and 10 MiB): written chunk by chunk straight from memory
    ("outputs.big", "float32", False, (16, 128, 1024), None, 3),
    ("grad_in.big", "bfloat16", False, (5, 2, 2**19), None, 2),
]


def _records(dn: str, ragged: bool, shape: tuple[int, ...], n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    st = dtypes.info(dn).storage
    out = []
    for i in range(n):
        shp = (shape[0] + i, *shape[1:]) if ragged else shape
        raw = rng.integers(0, 255, size=int(np.prod(shp)) * st.itemsize, dtype=np.uint8)
        arr = raw.view(np.uint8 if st == np.bool_ else st).reshape(shp)
        out.append(arr.astype(bool) if st == np.bool_ else arr)
    return out


def _write_new(path: Path, fields: list) -> HandleFileWriter:
    """Through HandleFileWriter (the writer's code)."""
    n = max((f[-1] for f in fields), default=0)
    w = HandleFileWriter(path, ATTRS, 5, None)
    for name, dn, ragged, shape, comp, k in fields:
        recs = _records(dn, ragged, shape, k)
        spec = FieldSpec(name, dn, ragged, shape, comp)
        out = w.field(spec, sum(r.size for r in recs) if ragged else k)
        if ragged:
            out.append(np.concatenate([r.reshape(-1) for r in recs]))
            out.offsets.append(np.cumsum([0] + [r.size for r in recs[:-1]]).astype(np.int64))
            out.shapes.append(np.array([r.shape for r in recs], np.int64))
        else:
            out.append(np.stack(recs[:1]))  # (two appends: a partial write after a first one)
            out.append(np.stack(recs[1:]))
        out.records.append(np.arange(5, 5 + k, dtype=np.int64))
        if spec.info.has_norm:
            out.norms.append(np.linspace(0, 1, k))
    w.add_index(np.arange(n, dtype=np.int64), np.zeros(n, np.int64))
    w.finish()
    return w


def _write_reference(path: Path, fields: list) -> None:
    """The same file through h5py's high-level API (create_dataset, create_group, attrs)."""
    n = max((f[-1] for f in fields), default=0)
    with h5py.File(path, "w", rdcc_nbytes=0) as f:
        dss = []
        for name, dn, ragged, shape, comp, k in fields:
            recs = _records(dn, ragged, shape, k)
            st = dtypes.info(dn).storage
            kw = compression_kwargs(comp)
            if ragged:
                flat = np.concatenate([r.reshape(-1) for r in recs])
                ds = f.create_dataset(name, shape=(0,), maxshape=(None,), dtype=st,
                                      chunks=flat_chunk(st.itemsize, flat.size), **kw)
                ds.resize((flat.size,))
                ds[:] = flat
            else:
                ds = f.create_dataset(name, shape=(0, *shape), maxshape=(None, *shape), dtype=st,
                                      chunks=record_chunk(shape, st.itemsize, k), **kw)
                ds.resize((1, *shape))
                ds[0:1] = np.stack(recs[:1])
                ds.resize((k, *shape))
                ds[1:k] = np.stack(recs[1:])
            dss.append((ds, recs))
        for name, arr in (("step", np.arange(n, dtype=np.int64)), ("call", np.zeros(n, np.int64))):
            f.create_dataset(name, data=arr, maxshape=(None,), chunks=index_chunk(n))
        idx = f.create_group(INDEX_GROUP)
        for (name, dn, ragged, shape, comp, k), (ds, recs) in zip(fields, dss):
            g = idx.create_group(name)
            g.create_dataset("record", data=np.arange(5, 5 + k, dtype=np.int64), maxshape=(None,),
                             chunks=index_chunk(k))
            if dtypes.info(dn).has_norm:
                g.create_dataset("norm", data=np.linspace(0, 1, k), maxshape=(None,), chunks=index_chunk(k))
            rows, data = ds.chunks[0], ds[()]  # (the chunk hashes: docs/format.md)
            hs = np.array([xxhash.xxh3_64_intdigest(np.ascontiguousarray(data[a : a + rows]).tobytes())
                           for a in range(0, data.shape[0], rows)], np.uint64)
            g.create_dataset("xxh3", data=hs, maxshape=(None,), chunks=index_chunk(len(hs))).attrs["rows"] = np.int64(rows)
            ds.attrs["dtype"] = dn
            ds.attrs["layout"] = "ragged" if ragged else "fixed"
            ds.attrs["ndim"] = np.int64(len(shape))
            ds.attrs["records"] = np.int64(k)
            if ragged:
                off = np.cumsum([0] + [r.size for r in recs[:-1]]).astype(np.int64)
                g.create_dataset("offset", data=off, maxshape=(None,), chunks=index_chunk(k))
                g.create_dataset("shape", data=np.array([r.shape for r in recs], np.int64),
                                 maxshape=(None, len(shape)), chunks=index_chunk(k, len(shape)))
            else:
                ds.attrs["shape"] = np.asarray(shape, dtype=np.int64)
        for key, v in ATTRS.items():
            f.attrs[key] = v
        f.attrs["hookline_format"] = FILE_FORMAT
        f.attrs["format_version"] = np.int64(FORMAT_VERSION)
        f.attrs["record_start"] = np.int64(5)
        f.attrs["records"] = np.int64(n)
        f.attrs["fields"] = json.dumps([fl[0] for fl in fields])


@pytest.mark.parametrize("which", ["all_fields", "one_fixed_field", "empty"])
def test_handle_file_is_byte_identical_to_h5py_high_level(tmp_path: Path, which: str) -> None:
    fields = {"all_fields": FIELDS, "one_fixed_field": FIELDS[:1], "empty": []}[which]
    new, ref = tmp_path / "new.h5", tmp_path / "ref.h5"
    w = _write_new(new, fields)
    _write_reference(ref, fields)
    assert new.read_bytes() == ref.read_bytes()
    with h5py.File(new, "r") as f:  # (and it holds what it should, as the writer says it does)
        assert same_structure(check_structure(f, str(new)), w.structure) is None
        assert f.attrs["hookline_format"] == FILE_FORMAT
        assert f.attrs["handle_id"] == ATTRS["handle_id"]
        assert json.loads(f.attrs["fields"]) == [fl[0] for fl in fields]
        for name, dn, ragged, shape, comp, k in fields:
            recs = _records(dn, ragged, shape, k)
            if not ragged:
                np.testing.assert_array_equal(f[name][:], np.stack(recs))
            assert f[name].attrs["records"] == k


def test_parked_file_is_byte_identical_to_h5py_high_level(tmp_path: Path) -> None:
    """A part closed and reopened between writes (more handles than open files): the same bytes
    as h5py's high-level API closing and reopening the file at the same points."""
    new, ref = tmp_path / "new.h5", tmp_path / "ref.h5"
    recs = np.stack(_records("float32", False, (4,), 6))
    w = HandleFileWriter(new, ATTRS, 0, None, hashes=False)  # (hashes: the test above)
    out = w.field(FieldSpec("outputs.0", "float32", False, (4,), None), 6)
    out.append(recs[:3])
    w.park()
    w.resume()
    out.append(recs[3:])
    out.records.append(np.arange(6, dtype=np.int64))
    out.norms.append(np.zeros(6))
    w.add_index(np.arange(6, dtype=np.int64), np.zeros(6, np.int64))
    w.park()
    w.finish()  # (reopens it)

    with h5py.File(ref, "w", rdcc_nbytes=0) as f:
        ds = f.create_dataset("outputs.0", shape=(0, 4), maxshape=(None, 4), dtype=np.float32,
                              chunks=record_chunk((4,), 4, 6))
        ds.resize((3, 4))
        ds[0:3] = recs[:3]
    with h5py.File(ref, "r+", rdcc_nbytes=0) as f:
        ds = f["outputs.0"]
        ds.resize((6, 4))
        ds[3:6] = recs[3:]
    with h5py.File(ref, "r+", rdcc_nbytes=0) as f:
        for name, arr in (("step", np.arange(6, dtype=np.int64)), ("call", np.zeros(6, np.int64))):
            f.create_dataset(name, data=arr, maxshape=(None,), chunks=index_chunk(6))
        g = f.create_group(INDEX_GROUP).create_group("outputs.0")
        g.create_dataset("record", data=np.arange(6, dtype=np.int64), maxshape=(None,), chunks=index_chunk(6))
        g.create_dataset("norm", data=np.zeros(6), maxshape=(None,), chunks=index_chunk(6))
        ds = f["outputs.0"]
        for key, v in (("dtype", "float32"), ("layout", "fixed"), ("ndim", np.int64(1)),
                       ("records", np.int64(6)), ("shape", np.asarray((4,), np.int64))):
            ds.attrs[key] = v
        for key, v in {**ATTRS, "hookline_format": FILE_FORMAT, "format_version": np.int64(FORMAT_VERSION),
                       "record_start": np.int64(0), "records": np.int64(6),
                       "fields": json.dumps(["outputs.0"])}.items():
            f.attrs[key] = v
    assert new.read_bytes() == ref.read_bytes()


def test_other_attribute_values_are_written_as_h5py_writes_them(tmp_path: Path) -> None:
    """Attribute values other than str and int64 (a copied file's own, e.g. by verify's repair)
    go through h5py: the same bytes as ``attrs[k] = v``."""
    attrs = {**ATTRS, "a_float": 1.5, "an_int": 3, "f32": np.float32(2), "arr": np.array([1.0, 2.0]),
             "i32": np.int32(4), "unicode": "größe"}
    new, ref = tmp_path / "new.h5", tmp_path / "ref.h5"
    HandleFileWriter(new, attrs, 0, None).finish()
    with h5py.File(ref, "w", rdcc_nbytes=0) as f:
        f.create_dataset("step", data=np.zeros(0, np.int64), maxshape=(None,), chunks=index_chunk(0))
        f.create_dataset("call", data=np.zeros(0, np.int64), maxshape=(None,), chunks=index_chunk(0))
        f.create_group(INDEX_GROUP)
        for key, v in {**attrs, "hookline_format": FILE_FORMAT, "format_version": np.int64(FORMAT_VERSION),
                       "record_start": np.int64(0), "records": np.int64(0), "fields": "[]"}.items():
            f.attrs[key] = v
    assert new.read_bytes() == ref.read_bytes()
