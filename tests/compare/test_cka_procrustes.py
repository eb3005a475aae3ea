"""CKA and Procrustes in compare_runs: against direct numpy references (1e-9) on recorded runs
whose layers are known transforms of each other, pooled over a field, in the CLI."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
from _compare_support import REFS, mlp, record_model, ref_cka, ref_procrustes, write_run

from hookline.storage import InvalidArgumentError, compare_runs, open_run
from hookline.storage.compare import pair_metrics

REP = ["cka", "procrustes"]


def _close(metric: str, got: float, want: float) -> None:
    """Equal to the reference within 1e-9; Procrustes compared as cos(theta): arccos near 0 turns
    a rounding error e of its argument into sqrt(2e) (~1e-8), in the reference as much as here."""
    if metric == "procrustes":
        got, want = np.cos(got), np.cos(want)
    assert got == pytest.approx(want, abs=1e-9)


def _orthogonal(d: int, seed: int) -> np.ndarray:
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((d, d)))
    return q


@pytest.mark.parametrize("shape", [(4, 6, 8), (2, 3, 16)], ids=["feature-space", "sample-space"])
def test_rotation_and_scale_give_cka_one_and_procrustes_zero(tmp_path, shape):
    rng = np.random.default_rng(1)
    q = _orthogonal(shape[-1], 2)
    xs = [rng.standard_normal(shape) + 3.0 for _ in range(4)]
    a = write_run(tmp_path / "a", {"fc": xs})
    b = write_run(tmp_path / "b", {"fc": [2.5 * x @ q for x in xs]})
    res = compare_runs(a, b, metrics=REP).get("outputs[fc]", "outputs.0")
    assert res.ok and len(res) == 4
    for k, x in enumerate(xs):
        rows = x.reshape(-1, shape[-1])
        for m in REP:
            _close(m, res.values[m][k], REFS[m](rows, 2.5 * rows @ q))
    np.testing.assert_allclose(res.values["cka"], 1.0, atol=1e-9)
    # arccos near 1 turns rounding of ~1e-16 into ~1e-8: zero means below ~1e-7
    np.testing.assert_allclose(res.values["procrustes"], 0.0, atol=1e-6)
    assert res.overall["cka"] == pytest.approx(1.0, abs=1e-9)
    assert res.overall["procrustes"] == pytest.approx(0.0, abs=1e-6)


def test_independent_features_give_cka_near_d_over_n(tmp_path):
    rng = np.random.default_rng(3)
    n, d = 2000, 16
    xs, ys = [rng.standard_normal((n, d))], [rng.standard_normal((n, d))]
    res = compare_runs(write_run(tmp_path / "a", {"fc": xs}), write_run(tmp_path / "b", {"fc": ys}),
                       metrics=REP).get("outputs[fc]")
    cka = res.values["cka"][0]
    assert cka == pytest.approx(ref_cka(xs[0], ys[0]), abs=1e-9)
    assert 0.5 * d / n < cka < 2 * d / n
    assert res.values["procrustes"][0] == pytest.approx(ref_procrustes(xs[0], ys[0]), abs=1e-9)
    assert res.values["procrustes"][0] > 1.3  # near pi/2: unrelated


def test_sequence_records_use_batch_times_seq_samples(tmp_path):
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal((4, 16, 8)) for _ in range(3)]
    ys = [x @ rng.standard_normal((8, 8)) + 0.5 * rng.standard_normal(x.shape) for x in xs]
    a, b = write_run(tmp_path / "a", {"fc": xs}), write_run(tmp_path / "b", {"fc": ys})
    tokens = compare_runs(a, b, metrics=REP).get("outputs[fc]")
    flat = compare_runs(a, b, metrics=REP, sample_dims=1).get("outputs[fc]")
    for k, (x, y) in enumerate(zip(xs, ys)):
        assert tokens.values["cka"][k] == pytest.approx(ref_cka(x.reshape(64, 8), y.reshape(64, 8)), abs=1e-9)
        assert flat.values["cka"][k] == pytest.approx(ref_cka(x.reshape(4, 128), y.reshape(4, 128)), abs=1e-9)
        assert flat.values["procrustes"][k] == pytest.approx(ref_procrustes(x.reshape(4, 128), y.reshape(4, 128)),
                                                             abs=1e-9)
    # 4 samples of 128 features look alike whatever they hold: the per-token value is the informative one
    assert np.all(flat.values["cka"] > tokens.values["cka"])


def test_overall_equals_the_reference_on_all_records_stacked(tmp_path):
    rng = np.random.default_rng(5)
    lengths = [5, 9, 7, 12, 3]
    xs = [rng.standard_normal((n, 6)) + 10.0 * k for k, n in enumerate(lengths)]  # means far apart
    ys = [np.tanh(x @ rng.standard_normal((6, 4))) for x in xs]  # another width: CKA compares those too
    a, b = write_run(tmp_path / "a", {"fc": xs}), write_run(tmp_path / "b", {"fc": ys})
    assert open_run(a)["outputs[fc]"]["outputs.0"].shape is None  # ragged
    res = compare_runs(a, b, metrics=REP).get("outputs[fc]")
    X, Y = np.vstack(xs), np.vstack(ys)
    assert res.overall["cka"] == pytest.approx(ref_cka(X, Y), abs=1e-9)
    assert res.overall["procrustes"] == pytest.approx(ref_procrustes(X, Y), abs=1e-9)
    assert compare_runs(a, b, metrics=REP).overall("cka") == {("outputs[fc]", "outputs.0"): res.overall["cka"]}
    # a step recorded in one run only is left out of the pooled value
    b2 = write_run(tmp_path / "b2", {"fc": ys[1:]}, steps=[1, 2, 3, 4])
    part = compare_runs(a, b2, metrics=["cka"]).get("outputs[fc]")
    assert part.overall["cka"] == pytest.approx(ref_cka(np.vstack(xs[1:]), np.vstack(ys[1:])), abs=1e-9)


def test_recorded_models_related_by_a_rotation(tmp_path):
    """Two real torch models; B's fc1 is A's fc1 followed by an orthogonal map (float32 records)."""
    import torch

    model_a = mlp(0)
    model_b = mlp(0)
    q = torch.tensor(_orthogonal(8, 6), dtype=torch.float32)
    with torch.no_grad():
        model_b.fc1.weight.copy_(q @ model_a.fc1.weight)
        model_b.fc1.bias.copy_(q @ model_a.fc1.bias)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(3, 5, 8, generator=gen) for _ in range(3)]  # (batch, seq, d)
    a = record_model(tmp_path / "a", model_a, inputs)
    b = record_model(tmp_path / "b", model_b, inputs)
    res = compare_runs(a, b, metrics=REP + ["cosine"])
    fc1 = res.get("outputs[fc1]")
    fa, fb = open_run(a)["outputs[fc1]"]["outputs.0"], open_run(b)["outputs[fc1]"]["outputs.0"]
    for k in range(3):
        x, y = fa[k].reshape(15, 8), fb[k].reshape(15, 8)
        assert fc1.values["cka"][k] == pytest.approx(ref_cka(x, y), abs=1e-9)
        _close("procrustes", fc1.values["procrustes"][k], ref_procrustes(x, y))
    np.testing.assert_allclose(fc1.values["cka"], 1.0, atol=1e-5)  # float32 records
    assert np.all(np.abs(fc1.values["cosine"]) < 0.9)  # what cosine says about the same layer
    assert res.get("outputs[fc2]").values["cka"].max() < 0.99  # fc2 does not undo the rotation


def test_widths_that_differ_compare_only_with_representation_metrics(tmp_path):
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((20, 8)) for _ in range(2)]
    a = write_run(tmp_path / "a", {"fc": xs})
    b = write_run(tmp_path / "b", {"fc": [x @ rng.standard_normal((8, 12)) for x in xs]})
    assert compare_runs(a, b, metrics=REP).get("outputs[fc]").ok
    mixed = compare_runs(a, b, metrics=["cosine", "cka"]).get("outputs[fc]")
    assert mixed.status == "shape_mismatch" and "[20, 8]" in mixed.message


def test_a_record_of_20000_samples_needs_no_n_by_n_matrix(tmp_path):
    rng = np.random.default_rng(8)
    n, d = 20_000, 64
    x = rng.standard_normal((n, d)).astype(np.float32)
    y = (x @ _orthogonal(d, 9).astype(np.float32) + 0.1 * rng.standard_normal((n, d))).astype(np.float32)
    a, b = write_run(tmp_path / "a", {"fc": [x]}), write_run(tmp_path / "b", {"fc": [y]})
    tracemalloc.start()
    try:
        res = compare_runs(a, b, metrics=REP).get("outputs[fc]")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert res.values["cka"][0] == pytest.approx(ref_cka(x, y), abs=1e-9)
    n_by_n = 8 * n * n  # 3.2 GB of float64
    assert peak < n_by_n / 40, f"peak {peak / 2**20:.0f} MiB"  # a few copies of the record (10 MB float64)


def test_bad_arguments_say_what_to_do(tmp_path):
    a = write_run(tmp_path / "a", {"fc": [np.ones((4, 3))]})
    with pytest.raises(InvalidArgumentError, match=r"sample_dims.*-1"):
        compare_runs(a, a, metrics=["cka"], sample_dims=-1)
    with pytest.raises(InvalidArgumentError, match=r"sample_dims=3 exceeds the 2 axes.*0\.\.2"):
        compare_runs(a, a, metrics=["cka"], sample_dims=3)
    with pytest.raises(InvalidArgumentError, match=r"'ckaa'.*procrustes"):
        compare_runs(a, a, metrics=["ckaa"])
    with pytest.raises(InvalidArgumentError, match=r"'cka'.*compare_runs"):
        pair_metrics(np.ones(3), np.ones(3), ["cka"])
    assert isinstance(InvalidArgumentError("x"), ValueError)


def test_cli_table_json_and_heatmap(tmp_path):
    from click.testing import CliRunner

    from hookline.cli.main import cli

    cli_runner = CliRunner()

    rng = np.random.default_rng(10)
    xs = [rng.standard_normal((2, 6, 4)) for _ in range(3)]
    a = write_run(tmp_path / "a", {"fc": xs, "head": xs})
    b = write_run(tmp_path / "b", {"fc": [x @ _orthogonal(4, 11) for x in xs],
                                   "head": [rng.standard_normal(x.shape) for x in xs]})
    out = cli_runner.invoke(cli, ["compare", str(a), str(b), "--metric", "cka", "-q"])
    assert out.exit_code == 0, out.output
    rows = {l.split()[0]: l.split() for l in out.output.splitlines() if l.startswith("outputs[")}
    assert rows["outputs[fc]"][2:] == ["3", "1/1", "1"]  # steps, mean/min per step, all steps
    assert float(rows["outputs[head]"][4]) < 0.9
    js = json.loads(cli_runner.invoke(cli, ["compare", str(a), str(b), "--metric", "cka", "--metric", "procrustes",
                                            "--json"]).output)
    assert js["metrics"] == ["cka", "procrustes"] and js["alignment"] is None
    r = next(x for x in js["results"] if x["handle"] == "outputs[fc]")
    assert set(r["overall"]) == {"cka", "procrustes"} and len(r["cka"]) == 3
    assert "cosine" not in r and r["handle_a"] == r["handle_b"] == "outputs[fc]"
    png = tmp_path / "heat.png"
    out = cli_runner.invoke(cli, ["compare", str(a), str(b), "--metric", "cka", "--plot", str(png), "-q"])
    assert out.exit_code == 0, out.output
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
