"""``hookline.storage.similarity``: N x N matrices over N runs, here and on a 2-process
dask.distributed LocalCluster (files opened in the workers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _compare_support import write_run

from hookline.storage import InvalidArgumentError, compare_runs, similarity


@pytest.fixture(scope="module")
def four_runs(tmp_path_factory):
    """Four runs of two handles: a base, a rotation of it, a noisy copy, unrelated features; the
    last one names its modules ``model.*`` (aligned with the first)."""
    root = tmp_path_factory.mktemp("sim")
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.standard_normal((6, 6)))
    base = [rng.standard_normal((3, 10, 6)) for _ in range(4)]
    other = [rng.standard_normal((3, 10, 6)) for _ in range(4)]
    variants = {
        "base": base,
        "rotated": [2.0 * x @ q for x in base],
        "noisy": [x + 0.7 * rng.standard_normal(x.shape) for x in base],
        "other": other,
    }
    paths = []
    for name, xs in variants.items():
        prefix = "model." if name == "other" else ""
        paths.append(str(write_run(root / name, {f"{prefix}enc": xs, f"{prefix}dec": [np.tanh(x) for x in xs]})))
    return paths


def test_similarity_is_symmetric_with_unit_diagonal_and_equals_compare_runs(four_runs):
    sims = similarity(four_runs, metric="cka")
    assert set(sims) == {"outputs[enc]", "outputs[dec]"}
    enc = sims["outputs[enc]"]
    assert enc.dims == ("run_a", "run_b") and list(enc.run_a.values) == four_runs
    assert enc.attrs == {"handle": "outputs[enc]", "field": "outputs.0", "metric": "cka"}
    m = enc.values
    np.testing.assert_array_equal(m, m.T)
    np.testing.assert_array_equal(np.diag(m), 1.0)
    for i in range(4):
        for j in range(i + 1, 4):
            want = compare_runs(four_runs[i], four_runs[j], metrics=["cka"]).get("outputs[enc]").overall["cka"]
            assert m[i, j] == pytest.approx(want, abs=1e-12)
    assert m[0, 1] == pytest.approx(1.0, abs=1e-9) and m[0, 2] < 0.95 and m[0, 3] < 0.2
    # a run without the handle: NaN in its row and column, its diagonal too
    lacking = str(write_run(Path(four_runs[0]).parent / "enc_only", {"enc": [np.ones((2, 3, 6))]}))
    dec = similarity([four_runs[0], lacking, four_runs[1]], metric="cka")["outputs[dec]"].values
    assert np.isnan(dec[1]).all() and np.isnan(dec[:, 1]).all() and dec[0, 0] == dec[2, 2] == 1.0
    want = compare_runs(four_runs[0], four_runs[1], metrics=["cka"]).get("outputs[dec]").overall["cka"]
    assert dec[0, 2] == dec[2, 0] == pytest.approx(want, abs=1e-12)
    dist = similarity(four_runs, handles="*enc*", metric="procrustes")["outputs[enc]"].values
    np.testing.assert_array_equal(np.diag(dist), 0.0)
    assert dist[0, 1] < 1e-6 < dist[0, 2] < dist[0, 3]


def test_on_a_two_process_local_cluster_equals_the_local_result(four_runs):
    from dask.distributed import Client, LocalCluster

    local = similarity(four_runs, metric="procrustes")
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        remote = similarity(four_runs, metric="procrustes", client=client)
        workers = client.run(lambda: (__import__("os").getpid(), __import__("hookline.storage").storage.__file__))
    assert len({pid for pid, _ in workers.values()}) == 2
    assert {f for _, f in workers.values()} == {sys.modules["hookline.storage"].__file__}
    assert set(remote) == set(local)
    for h in local:
        np.testing.assert_allclose(remote[h].values, local[h].values, rtol=0, atol=1e-12)


def test_bad_arguments(four_runs):
    with pytest.raises(InvalidArgumentError, match="at least 2 runs"):
        similarity(four_runs[:1])
    with pytest.raises(InvalidArgumentError, match=r"cka, procrustes, got 'cosine'"):
        similarity(four_runs, metric="cosine")
    with pytest.raises(InvalidArgumentError, match="given twice"):
        similarity([four_runs[0], four_runs[0]])
    with pytest.raises(InvalidArgumentError, match=r"'nope\*'"):
        similarity(four_runs, handles="nope*")
    with pytest.raises(InvalidArgumentError, match=r"field 'grad_out.0'"):
        similarity(four_runs, field="grad_out.0")


def test_without_xarray_the_error_names_the_extra(four_runs):
    code = ("import sys; sys.modules['xarray'] = None\n"
            "from hookline.storage import similarity, MissingDependencyError\n"
            f"try:\n    similarity({four_runs[:2]!r})\n"
            "except MissingDependencyError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert 'pip install "hookline[analysis]"' in out.stdout, out.stderr
