"""Damaged and hostile handle files and manifests (issue 23, cases 3, 6, 7, 8, 9): nothing outside
the run is read, every damage is reported (reader problems, verify, exit status), nothing crashes.

Every run here is written by the real RunWriter, then altered with h5py or raw bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from hookline.cli.main import cli
from hookline.storage import FormatError, RunWriter, open_run, verify

FIXED = "outputs[fc]"  # fixed-shape field "outputs.0": float32 (4,), value i in record i
RAGGED = "rag"  # ragged field "x": int64 arange(i % 3 + 1) in record i
N = 6
SECRET = b"SECRET!!" * 12  # 96 bytes: the size of FIXED's data, (6, 4) float32


def _write_run(run: Path) -> Path:
    w = RunWriter(run)
    w.add_handle(FIXED, module_name="fc", meta={"kind": "outputs"})
    w.add_handle(RAGGED, module_name="r")
    for i in range(N):
        w.write(FIXED, i, 0, {"outputs.0": np.full((4,), i, np.float32)})
        w.write(RAGGED, i, 0, {"x": np.arange(i % 3 + 1, dtype=np.int64)})
    w.close()
    return run


def _file(run: Path, hid: str) -> Path:
    return run / ("outputs/fc.h5" if hid == FIXED else "rag.h5")


def _invoke(*args: object):
    try:
        runner = CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        runner = CliRunner()
    res = runner.invoke(cli, [str(a) for a in args])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.stderr and "unexpected" not in res.stderr, res.stderr
    return res


def _replace_dataset(h: h5py.File, name: str, make) -> None:
    """Replace dataset ``name`` by ``make(h, name)``, keeping its attributes."""
    attrs = dict(h[name].attrs)
    del h[name]
    make(h, name)
    for k, v in attrs.items():
        h[name].attrs[k] = v


def _secret_h5(path: Path) -> Path:
    with h5py.File(path, "w") as s:
        s.create_dataset("secret", data=np.frombuffer(SECRET, np.float32).reshape(N, 4))
    return path


# ----------------------------------------------------------------------------- case 3
def _external_storage(h: h5py.File, outside: Path) -> None:
    (outside / "secret.bin").write_bytes(SECRET)
    _replace_dataset(h, "outputs.0", lambda g, nm: g.create_dataset(
        nm, shape=(N, 4), dtype=np.float32, external=[(str(outside / "secret.bin"), 0, len(SECRET))]))


def _external_link(h: h5py.File, outside: Path) -> None:
    _secret_h5(outside / "secret.h5")
    attrs = dict(h["outputs.0"].attrs)
    del h["outputs.0"]
    h["outputs.0"] = h5py.ExternalLink(str(outside / "secret.h5"), "/secret")
    with h5py.File(outside / "secret.h5", "r+") as s:  # (so that the linked dataset passes as the field)
        for k, v in attrs.items():
            s["secret"].attrs[k] = v


def _virtual_dataset(h: h5py.File, outside: Path) -> None:
    _secret_h5(outside / "secret.h5")

    def make(g: h5py.File, nm: str) -> None:
        layout = h5py.VirtualLayout(shape=(N, 4), dtype=np.float32)
        layout[:] = h5py.VirtualSource(str(outside / "secret.h5"), "secret", shape=(N, 4))
        g.create_virtual_dataset(nm, layout)

    _replace_dataset(h, "outputs.0", make)


def _object_references(h: h5py.File, outside: Path) -> None:
    h.create_dataset("refs", data=np.array([h["step"].ref]), dtype=h5py.ref_dtype)


@pytest.mark.parametrize("alter, refused", [
    (_external_storage, "external storage"),
    (_external_link, "external link"),
    (_virtual_dataset, "virtual dataset"),
    (_object_references, "references"),
])
def test_a_file_reaching_outside_itself_is_refused_never_followed(tmp_path, alter, refused):
    """Case 3: verify said OK, export wrote the outside bytes, repair copied them into the run."""
    run = _write_run(tmp_path / "run")
    outside = tmp_path / "elsewhere-9f3a"
    outside.mkdir()
    with h5py.File(_file(run, FIXED), "r+") as h:
        alter(h, outside)

    rep = verify(run)
    assert not rep.ok
    (hr,) = [h for h in rep.handles if h.handle_id == FIXED]
    assert any(refused in p and "outputs/fc.h5" in p for p in hr.problems), hr.problems
    assert next(h for h in rep.handles if h.handle_id == RAGGED).ok  # the rest is checked

    with pytest.warns(UserWarning, match="unreadable"):
        assert len(open_run(run)[FIXED]) == 0
    res = _invoke("export", run, FIXED, "outputs.0", "--format", "npy", "--out", tmp_path / "x.npy")
    assert res.exit_code != 0 and "outputs/fc.h5" in res.stderr
    assert not (tmp_path / "x.npy").exists()

    res = _invoke("verify", run, "--repair")
    assert res.exit_code == 3, (res.stdout, res.stderr)  # repaired, but a file was moved aside
    assert (run / ".quarantine" / "outputs" / "fc.h5").exists()
    for p in run.rglob("*"):  # no file of the run (the quarantine aside) holds or points outside
        if p.is_file() and ".quarantine" not in p.parts:
            assert SECRET not in p.read_bytes() and b"elsewhere-9f3a" not in p.read_bytes(), p
    assert verify(run).ok and len(open_run(run)[RAGGED]) == N


# ----------------------------------------------------------------------------- case 6
def test_a_truncated_final_file_is_a_listed_problem_with_a_warning(tmp_path):
    """Case 6: open_run returned the handle as empty, with no warning and empty problems."""
    run = _write_run(tmp_path / "run")
    f = _file(run, FIXED)
    f.write_bytes(f.read_bytes()[:3000])
    h = open_run(run)[FIXED]
    with pytest.warns(UserWarning, match=r"skipping 1 unreadable file of handle 'outputs\[fc\]'"):
        assert len(h) == 0
    assert len(h.problems) == 1 and "outputs/fc.h5" in h.problems[0] and "truncated" in h.problems[0]
    assert len(open_run(run)[RAGGED]) == N  # the rest of the run reads
    res = _invoke("show", run, FIXED)
    assert res.exit_code != 0 and "outputs/fc.h5" in res.stderr and len(res.stderr.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- case 7
def _meta_not_json(f: Path) -> None:
    with h5py.File(f, "r+") as h:
        h.attrs["meta"] = "{not json"


def _meta_heap_bit_flip(f: Path) -> None:
    """One bit of the ``meta`` string in the file's global heap (where HDF5 keeps string
    attributes): '{"kind"...' becomes '{#kind"...'."""
    data = bytearray(f.read_bytes())
    at = data.find(b'{"kind": "outputs"}')
    assert at > 0 and data.find(b'{"kind": "outputs"}', at + 1) < 0
    data[at + 1] ^= 0x01
    f.write_bytes(bytes(data))


def _meta_object_reference(f: Path) -> None:
    with h5py.File(f, "r+") as h:
        h.attrs["meta"] = h["step"].ref


@pytest.mark.parametrize("damage", [_meta_not_json, _meta_heap_bit_flip, _meta_object_reference])
def test_a_corrupt_attribute_is_one_damaged_file_not_a_crash(tmp_path, damage):
    """Case 7: verify and verify --repair crashed for the whole run."""
    run = _write_run(tmp_path / "run")
    damage(_file(run, FIXED))
    rep = verify(run)
    assert not rep.ok
    by_id = {h.handle_id: h for h in rep.handles}
    assert any("outputs/fc.h5" in p and "meta" in p for p in by_id[FIXED].problems), by_id[FIXED].problems
    assert by_id[RAGGED].ok and by_id[RAGGED].records == N
    res = _invoke("verify", run)
    assert res.exit_code == 1 and "PROBLEMS" in res.stdout
    res = _invoke("verify", run, "--repair")
    assert res.exit_code == 3 and "REPAIRED, DAMAGE FOUND" in res.stdout, (res.stdout, res.stderr)
    assert _invoke("verify", run).exit_code == 0
    assert open_run(run)[RAGGED]["x"][2].tolist() == [0, 1, 2]


# ----------------------------------------------------------------------------- case 8
def _shape_of(i: int, value: int):
    def alter(h: h5py.File) -> None:
        h["_index/x/shape"][i] = [value]
    return alter


def _offset_of(i: int, value: int):
    def alter(h: h5py.File) -> None:
        h["_index/x/offset"][i] = value
    return alter


@pytest.mark.parametrize("alter", [
    _shape_of(1, 1),  # record 1 read back as [0] instead of [0, 1]
    _shape_of(0, 5),  # record 0 reads into record 1's elements
    _offset_of(2, 2),  # record 2 overlaps record 1
    _offset_of(0, 1 << 40),  # far outside the data
    _shape_of(1, -2),
], ids=["shorter", "longer", "overlap", "outside", "negative"])
def test_every_ragged_record_is_checked(tmp_path, alter):
    """Case 8: verify checked the last record only; an earlier one read wrong data or failed."""
    run = _write_run(tmp_path / "run")
    with h5py.File(_file(run, RAGGED), "r+") as h:
        alter(h)
    rep = verify(run)
    assert not rep.ok
    (hr,) = [h for h in rep.handles if h.handle_id == RAGGED]
    assert any("rag.h5" in p and "ragged index" in p for p in hr.problems), hr.problems
    assert _invoke("verify", run).exit_code == 1
    fld = open_run(run)[RAGGED]["x"]
    for i in range(3):
        with pytest.raises(FormatError, match="ragged index"):
            fld[i]


# ----------------------------------------------------------------------------- case 9
@pytest.mark.parametrize("path, value", [
    (("world_size",), [2]),
    (("rank",), "0"),
    (("meta",), [1, 2]),
    (("handles", FIXED, "key"), 5),
    (("handles", FIXED, "records"), "6"),
    (("handles", FIXED, "meta"), "x"),
    (("handles", FIXED, "fields"), [1]),
    (("handles", FIXED), [1]),
])
def test_manifest_values_of_the_wrong_type_are_a_format_error(tmp_path, path, value):
    """Case 9: the manifest check passed and the reader crashed ("unexpected <Type> ... this is
    a bug" from every command)."""
    run = _write_run(tmp_path / "run")
    m = json.loads((run / "manifest.json").read_text())
    target = m
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = value
    (run / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError) as e:
        open_run(run)
    assert "manifest.json" in str(e.value) and path[-1] in str(e.value), str(e.value)
    for args in (("show", run), ("show", run, RAGGED), ("export", run, RAGGED, "x", "--format", "h5", "--out",
                                                         tmp_path / "x.h5"), ("verify", run)):
        res = _invoke(*args)
        assert res.exit_code == 1 and path[-1] in res.stderr + res.stdout, (args, res.stdout, res.stderr)
    assert _invoke("verify", run, "--repair").exit_code == 3  # the manifest moved aside, rebuilt
    assert len(open_run(run)[RAGGED]) == N and len(open_run(run)[FIXED]) == N


# ----------------------------------------------------------------------------- verify's exit status
def test_a_repair_that_moved_a_file_aside_does_not_end_in_ok(tmp_path):
    """A repair that quarantined records said OK and exited 0."""
    run = _write_run(tmp_path / "run")
    f = _file(run, FIXED)
    f.write_bytes(f.read_bytes()[:3000])
    assert _invoke("verify", run).exit_code == 1
    res = _invoke("verify", run, "--repair", "--json")
    assert res.exit_code == 3, (res.stdout, res.stderr)
    d = json.loads(res.stdout)
    assert d["ok"] is True and d["clean"] is False and d["moved"] == ["outputs/fc.h5"]
    res = _invoke("verify", run, "--repair")  # nothing left to repair: clean
    assert res.exit_code == 0 and res.stdout.startswith(f"{run}: OK")
    assert json.loads((run / "manifest.json").read_text())["handles"][FIXED]["lost"]


def test_a_merge_failing_on_unchecked_data_quarantines_that_file_and_merges_the_rest(tmp_path):
    """A damaged chunk in the middle of a segment without chunk hashes (verify reads the first and
    last records only; with hashes, the default, it reads every block and finds it first): the
    repair's merge raised and verify --repair crashed for the whole run."""
    run = tmp_path / "run"
    w = RunWriter(run, compression="gzip", merge_on_close=False, checksums=False)
    w.add_handle(FIXED)
    w.add_handle(RAGGED)
    big = (1 << 18,)  # 1 MiB float32 records: one chunk each
    for i in range(10):
        w.write(FIXED, i, 0, {"outputs.0": np.full(big, i, np.float32)})
        w.write(RAGGED, i, 0, {"x": np.arange(i % 3 + 1, dtype=np.int64)})
        if i in (4, 9):
            w.flush()
    w.close()
    segs = sorted((run / "outputs").glob("fc.r*.h5seg"))
    assert len(segs) == 2
    with h5py.File(segs[0], "r") as h:
        info = h["outputs.0"].id.get_chunk_info_by_coord((2, 0))
    data = bytearray(segs[0].read_bytes())
    data[info.byte_offset + info.size // 2: info.byte_offset + info.size // 2 + 16] = b"\xff" * 16
    segs[0].write_bytes(bytes(data))

    res = _invoke("verify", run, "--repair")
    assert res.exit_code == 3, (res.stdout, res.stderr)
    assert (run / ".quarantine" / "outputs" / segs[0].name).exists()
    run_ = open_run(run)
    assert run_[FIXED].steps.tolist() == list(range(5, 10)) and len(run_[RAGGED]) == 10
    assert float(run_[FIXED]["outputs.0"][0][0]) == 5.0
    lost = json.loads((run / "manifest.json").read_text())["handles"][FIXED]["lost"]
    assert any(segs[0].name in x for x in lost), lost
