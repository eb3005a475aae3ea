"""The lazy arrays compute on a real ``dask.distributed`` LocalCluster of process workers
(SPEC §12): files open inside the workers, results equal numpy's."""

from __future__ import annotations

import numpy as np
import pytest

from _analysis_runs import write_big
from hookline.storage import open_run


@pytest.fixture(scope="module")
def client():
    from dask.distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None,
                      memory_limit="1GiB") as cluster, Client(cluster) as c:
        yield c


def test_reductions_on_process_workers_equal_numpy(client, tmp_path):
    data = write_big(tmp_path / "run", records=96, shape=(64, 64), dtype=np.int32)  # 16 KiB records
    with open_run(tmp_path / "run") as run:
        f = run["outputs[big]"]["outputs.0"]
        x = f.to_dask(chunks=64)
        assert x.numblocks[0] == 2
        assert x[:5].compute(scheduler="threads").shape == (5, 64, 64)  # the driver opened its file first
        xa = f.to_xarray(chunks=64, dims=("batch", "feature"))
        # (one round trip; the source travels pickled, without the driver's open file)
        total, whole, means = client.compute(
            [x.astype(np.int64).sum(), x, xa.isel(record=(xa.step >= 10) & (xa.step <= 20)).mean("batch")], sync=True)
        assert total == data.astype(np.int64).sum()
        assert np.array_equal(whole, data)
        np.testing.assert_allclose(means.values, data[10:21].mean(axis=1), rtol=1e-12)
        np.testing.assert_array_equal(means["step"], np.arange(10, 21))
        # both workers took part: each opened the file in its own process
        seen = client.run(lambda: __import__("os").getpid())
        assert len(set(seen.values())) == 2
