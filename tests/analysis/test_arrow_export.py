"""``hookline export RUN --format arrow``: a ``datasets.load_from_disk`` directory with one
column per field, rows aligned, equal to the recorded rows (SPEC §14)."""

from __future__ import annotations

import subprocess
import sys

import datasets
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from _dataset_support import A, B, expected_keys, keys_of, write_run
from hookline.cli.main import cli
from hookline.storage import InvalidArgumentError, RunWriter, open_run
from hookline.storage.analysis.dataset_arrow import export_arrow


def _export(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(cli, ["export", *args])
    return res.exit_code, res.output


def test_cli_export_equals_the_recorded_rows(tmp_path):
    run = write_run(tmp_path / "run", skip_b=(2,))
    code, out = _export(str(run), "--format", "arrow", "--out", str(tmp_path / "acts"), "--field", A, "--field", B)
    assert code == 0, out
    assert "exported 132 rows of 2 fields" in out
    ds = datasets.load_from_disk(str(tmp_path / "acts"))
    assert ds.column_names == [A, B, "step", "call", "rank", "sample"]
    assert ds.features[A] == datasets.List(datasets.Value("float32"), length=4)
    t = ds.with_format("torch")[:]
    assert keys_of(t[A]) == expected_keys(skip=(2,))  # record order, step 2 left out (b lacks it)
    assert torch.equal(t[A][:, :3], t[B][:, :3])
    # the columns are the recorded records, row by row
    r = open_run(run)
    fa = r["outputs[a]"]["outputs.0"]
    keep = [i for i, s in enumerate(fa.steps) if s != 2]
    np.testing.assert_array_equal(t[A].numpy(), fa.read()[keep].reshape(-1, 4))
    assert t["step"].tolist() == [k[0] for k in expected_keys(skip=(2,))]
    assert t["sample"].tolist() == [k[2] for k in expected_keys(skip=(2,))]


def test_whole_records_steps_and_bfloat16_as_exact_float32(tmp_path):
    run = write_run(tmp_path / "bf", steps=4, bf16=True)
    code, out = _export(str(run), "outputs[a]", "--format", "arrow", "--out", str(tmp_path / "recs"),
                        "--rows", "record", "--steps", "1:3")
    assert code == 0, out
    ds = datasets.load_from_disk(str(tmp_path / "recs"))
    assert ds.column_names == [A, "step", "call", "rank", "sample"]
    got = ds.with_format("numpy")[:]
    want = open_run(run)["outputs[a]"]["outputs.0"]
    np.testing.assert_array_equal(got[A], want[2:6])  # steps 1 and 2, calls 0 and 1: exact float32
    assert got["step"].tolist() == [1, 1, 2, 2] and got[A].shape == (4, 2, 3, 7)


def test_the_default_exports_every_field_and_refuses_what_does_not_line_up(tmp_path):
    run = write_run(tmp_path / "lab", steps=2, labels=True)
    code, out = _export(str(run), "--format", "arrow", "--out", str(tmp_path / "x"))
    assert code == 1 and "Error: rows of 'inputs[emb]/inputs.0' (2 per record) do not line up" in out
    assert not (tmp_path / "x").exists()
    code, out = _export(str(run), "--format", "arrow", "--out", str(tmp_path / "x"), "--rows", "record")
    assert code == 0, out
    assert datasets.load_from_disk(str(tmp_path / "x")).num_rows == 4


def test_existing_outputs_and_bad_references(tmp_path):
    run = write_run(tmp_path / "run", steps=2)
    dest = tmp_path / "acts"
    assert _export(str(run), "--format", "arrow", "--out", str(dest), "--field", A)[0] == 0
    code, out = _export(str(run), "--format", "arrow", "--out", str(dest), "--field", A)
    assert code == 1 and f"output '{dest}' exists; pass --force" in out
    code, out = _export(str(run), "--format", "arrow", "--out", str(dest), "--field", B, "--force")
    assert code == 0 and datasets.load_from_disk(str(dest)).column_names[0] == B
    (tmp_path / "plain").mkdir()
    code, out = _export(str(run), "--format", "arrow", "--out", str(tmp_path / "plain"), "--field", A, "--force")
    assert code == 1 and "is not a datasets directory" in out
    code, out = _export(str(run), "--format", "arrow", "--out", str(tmp_path / "y"), "--field", "outputs[a]")
    assert code == 1 and out.count("\n") == 1 and "field reference 'outputs[a]' is not 'handle/field'" in out
    code, out = _export(str(run), "--format", "arrow", "--out", str(run / "inside"), "--field", A)
    assert code == 1 and "inside the run directory" in out
    code, out = _export(str(run), "--format", "npy", "--out", str(tmp_path / "z.npy"))
    assert code == 2 and "--format npy exports one field: give HANDLE" in out


def test_complex_fields_are_refused_and_nothing_is_written(tmp_path):
    with RunWriter(tmp_path / "c") as w:
        w.add_handle("outputs[fft]", module_name="fft", module_type="F", category="forward_hook",
                     hook_fn_name="outputs")
        w.write("outputs[fft]", 0, 0, {"outputs.0": np.ones((2, 3), np.complex64)})
    with pytest.raises(InvalidArgumentError, match="is complex64; Arrow has no complex type"):
        export_arrow(tmp_path / "c", "outputs[fft]/outputs.0", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_without_datasets_the_export_says_which_extra_to_install(tmp_path):
    run = write_run(tmp_path / "run", steps=1)
    code = ("import sys; sys.modules['datasets'] = None\n"
            "from click.testing import CliRunner\nfrom hookline.cli.main import cli\n"
            f"r = CliRunner().invoke(cli, ['export', {str(run)!r}, '--format', 'arrow', '--out', "
            f"{str(tmp_path / 'o')!r}])\nprint(r.exit_code, r.output)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.stdout.startswith("1 Error: the Arrow export needs the 'datasets' package"), res.stdout + res.stderr
    assert 'pip install "hookline[datasets]"' in res.stdout and res.stdout.rstrip("\n").count("\n") == 0
