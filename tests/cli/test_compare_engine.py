"""The streaming comparison engine (hookline.storage.compare) on runs made with the real Recorder."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from hookline.storage import InvalidArgumentError, compare_runs, open_run
from hookline.storage.compare import METRICS, STATUSES, pair_metrics


def _numpy_metrics(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    a = np.asarray(a, np.float64).ravel()
    b = np.asarray(b, np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return {"cosine": float(a @ b / (na * nb)), "rel_l2": float(np.linalg.norm(a - b) / na),
            "norm_ratio": float(nb / na)}


def test_identical_runs_give_cosine_one(runs):
    res = compare_runs(runs["a"], runs["a_same"])
    assert res.results and all(r.status == "ok" for r in res)
    handles = {r.handle for r in res}
    assert {"outputs[fc1]", "outputs[head]", "grads[fc1]", "grads[head]"} <= handles
    for r in res:
        assert len(r) == 4  # steps 0, 3, 6, 9
        np.testing.assert_allclose(r.values["cosine"], 1.0, atol=1e-12)
        np.testing.assert_allclose(r.values["rel_l2"], 0.0, atol=1e-12)
        np.testing.assert_allclose(r.values["norm_ratio"], 1.0, atol=1e-12)


def test_different_runs_match_numpy(runs):
    res = compare_runs(runs["a"], runs["b"])
    ra, rb = open_run(runs["a"]), open_run(runs["b"])
    checked = 0
    for r in res:
        assert r.status == "ok", r
        fa, fb = ra[r.handle][r.field], rb[r.handle][r.field]
        sa = list(zip(fa.steps.tolist(), fa.calls.tolist()))
        sb = list(zip(fb.steps.tolist(), fb.calls.tolist()))
        for k, (s, c) in enumerate(zip(r.steps.tolist(), r.calls.tolist())):
            want = _numpy_metrics(fa[sa.index((s, c))], fb[sb.index((s, c))])
            for m in METRICS:
                assert r.values[m][k] == pytest.approx(want[m], rel=1e-9, abs=1e-12), (r.handle, r.field, s, m)
            checked += 1
    assert checked >= 16
    # step 0: same init and data -> identical; later steps differ
    g = res.get("grads[fc1]", "grad_out.0")
    assert g.values["cosine"][0] == pytest.approx(1.0)
    assert g.values["rel_l2"][-1] > 1e-3


def test_small_blocks_give_the_same_result(runs):
    """Bounded memory: a tiny read budget (one record per block) changes nothing."""
    big = compare_runs(runs["a"], runs["b"])
    small = compare_runs(runs["a"], runs["b"], block_bytes=1)
    for x, y in zip(big, small):
        for m in METRICS:
            np.testing.assert_array_equal(x.values[m], y.values[m])


def test_shape_mismatch_is_reported(runs):
    res = compare_runs(runs["a"], runs["wide"], handles="outputs[fc1]")
    (r,) = res.results
    assert r.status == "shape_mismatch"
    assert "16" in r.message and "24" in r.message
    assert r.mismatched == len(r.steps) > 0  # every common pair skipped (was 0)
    # head outputs have the same shape: still compared
    assert compare_runs(runs["a"], runs["wide"], handles="outputs[head]").results[0].status == "ok"


def test_no_common_steps_is_reported(runs):
    res = compare_runs(runs["a"], runs["offset"], handles="grads[*]")
    assert {r.status for r in res} == {"no_common_steps"}
    assert all("no common" in r.message for r in res)


def test_missing_handles_and_fields(runs):
    res = compare_runs(runs["a"], runs["twice_a"])
    by_status = {r.status for r in res}
    assert by_status == {"missing_in_a", "missing_in_b"}
    miss = res.get("outputs[lin]")
    assert miss.status == "missing_in_a" and miss.field is None and "not in run A" in miss.message


def test_several_calls_compared_call_by_call(runs):
    res = compare_runs(runs["twice_a"], runs["twice_b"])
    (r,) = res.results
    assert r.status == "ok"
    assert r.calls.tolist() == [0, 1] * 4 and r.steps.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    fa, fb = open_run(runs["twice_a"])["outputs[lin]"]["outputs.0"], open_run(runs["twice_b"])["outputs[lin]"]["outputs.0"]
    for k in range(len(r)):
        want = _numpy_metrics(fa[k], fb[k])
        assert r.values["rel_l2"][k] == pytest.approx(want["rel_l2"], rel=1e-9, abs=1e-12)
    assert r.values["rel_l2"][0] == pytest.approx(0.0, abs=1e-12)  # step 0 unscaled
    assert r.values["rel_l2"][2] > 0.1  # step 1 scaled


def test_ragged_fields_compare_where_shapes_agree(runs):
    res = compare_runs(runs["ragged_a"], runs["ragged_b"])
    (r,) = res.results
    assert r.status == "ok"
    assert r.mismatched == 1 and "step 1" in r.message
    assert np.isnan(r.values["cosine"][1]) and np.isfinite(r.values["cosine"][[0, 2, 3]]).all()
    d = r.to_dict()
    assert d["cosine"][1] is None and d["shape_a"] is None


def test_globs_are_literal_about_brackets(runs):
    res = compare_runs(runs["a"], runs["b"], handles="grads[*]", fields="grad_out.*")
    assert {(r.handle, r.field) for r in res} == {("grads[fc1]", "grad_out.0"), ("grads[head]", "grad_out.0")}
    with pytest.raises(InvalidArgumentError, match="nope"):
        compare_runs(runs["a"], runs["b"], handles="nope*")
    with pytest.raises(InvalidArgumentError, match="grad_zzz"):
        compare_runs(runs["a"], runs["b"], fields="grad_zzz")
    with pytest.raises(InvalidArgumentError, match="bogus"):
        compare_runs(runs["a"], runs["b"], metrics=["bogus"])


def test_to_dict_is_json_with_documented_keys(runs):
    d = compare_runs(runs["a"], runs["b"], metrics=["cosine"]).to_dict()
    json.dumps(d, allow_nan=False)
    assert d["metrics"] == ["cosine"]
    r = d["results"][0]
    for key in ("handle", "field", "status", "message", "common_steps", "steps", "calls", "cosine", "summary"):
        assert key in r
    assert "rel_l2" not in r
    assert set(STATUSES) >= {x["status"] for x in d["results"]}


def test_pair_metrics_edge_cases():
    z, o = np.zeros(3), np.ones(3)
    assert pair_metrics(z, z) == {"cosine": 1.0, "rel_l2": 0.0, "norm_ratio": 1.0}
    m = pair_metrics(o, z)
    assert np.isnan(m["cosine"]) and m["rel_l2"] == 1.0 and m["norm_ratio"] == 0.0
    assert pair_metrics(o, -o)["cosine"] == pytest.approx(-1.0)
    with pytest.raises(InvalidArgumentError):
        pair_metrics(np.zeros(2), np.zeros(3))


def test_compare_module_does_not_import_torch():
    import subprocess

    code = ("import sys; import hookline.storage.compare as c; "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def _write_big_run(path, scale: float, n: int = 24, shape=(256, 512)):
    from hookline.storage import RunWriter

    rng = np.random.default_rng(0)
    w = RunWriter(path)
    w.add_handle("outputs[big]", module_name="big", module_type="torch.nn.Linear", category="forward_hook")
    for step in range(n):
        x = rng.standard_normal(shape, dtype=np.float32)
        w.write("outputs[big]", step, 0, {"outputs.0": x * (scale if step % 2 else 1.0)})
    w.close()


def test_compare_streams_with_bounded_memory(tmp_path):
    """24 records of 512 KB per run (12 MB of float32, 24 MB as float64): with a 1 MB read budget
    the numpy memory in use stays at a few records, independent of the run size."""
    import tracemalloc

    _write_big_run(tmp_path / "a", 1.0)
    _write_big_run(tmp_path / "b", 2.0)
    record = 256 * 512 * 8  # one record as float64
    ra, rb = open_run(tmp_path / "a"), open_run(tmp_path / "b")
    tracemalloc.start()
    try:
        res = compare_runs(ra, rb, block_bytes=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    (r,) = res.results
    assert r.status == "ok" and len(r) == 24
    np.testing.assert_allclose(r.values["cosine"], 1.0, atol=1e-9)
    np.testing.assert_allclose(r.values["norm_ratio"], [1.0, 2.0] * 12, rtol=1e-9)
    assert peak < 10 * record, f"peak {peak / 1e6:.1f} MB for {24 * record / 1e6:.0f} MB of data"


def test_distributed_runs_pair_on_rank(tmp_path):
    """Two ranks record the same (step, call): each rank is compared with the same rank."""
    from hookline.storage import RunWriter

    def write(path, factor_rank1: float):
        for rank in (0, 1):
            w = RunWriter(path, rank=rank, world_size=2)
            w.add_handle("outputs[x]", module_name="x", module_type="torch.nn.Linear", category="forward_hook")
            for step in range(3):
                x = np.full((2, 3), step + 1.0 + 10 * rank, np.float32)
                w.write("outputs[x]", step, 0, {"outputs.0": x * (factor_rank1 if rank == 1 else 1.0)})
            w.close()

    write(tmp_path / "a", 1.0)
    write(tmp_path / "b", 3.0)
    (r,) = compare_runs(tmp_path / "a", tmp_path / "b").results
    assert r.status == "ok" and len(r) == 6 and r.only_a == 0
    assert sorted(zip(r.ranks.tolist(), r.steps.tolist())) == [(k, s) for k in (0, 1) for s in range(3)]
    ratio = dict(zip(zip(r.ranks.tolist(), r.steps.tolist()), r.values["norm_ratio"].tolist()))
    assert all(ratio[(0, s)] == pytest.approx(1.0) and ratio[(1, s)] == pytest.approx(3.0) for s in range(3))
    assert r.to_dict()["ranks"] is not None


def test_norm_ratio_only_uses_stored_norms(runs, monkeypatch):
    full = compare_runs(runs["a"], runs["b"])
    ra, rb = open_run(runs["a"]), open_run(runs["b"])

    from hookline.storage import reader

    def no_data(self, *a, **k):
        raise AssertionError("data read although only norms were needed")

    monkeypatch.setattr(reader.Field, "__getitem__", no_data)
    fast = compare_runs(ra, rb, metrics=["norm_ratio"])
    for x, y in zip(full, fast):
        np.testing.assert_allclose(y.values["norm_ratio"], x.values["norm_ratio"], rtol=1e-6)


def test_cli_metric_choices_are_the_engine_metrics():
    """The CLI spells the metrics out (building it imports no storage); they must stay the engine's."""
    from hookline.cli.compare import DEFAULT_METRICS, METRIC_CHOICES
    from hookline.storage.compare import ALL_METRICS

    assert METRIC_CHOICES == ALL_METRICS and DEFAULT_METRICS == METRICS
