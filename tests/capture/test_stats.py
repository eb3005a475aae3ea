"""mode="stats" summaries match numpy computed on the full tensors (tracker/capture/stats.py)."""

import numpy as np
import pytest
import torch

from hookline.storage import InvalidArgumentError
from hookline.tracker.capture.stats import SCALAR_STATS, StatsSpec, compute_stats, split_stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32])
def test_stats_match_numpy(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(7, 13, generator=g) * 3).to(dtype)
    spec = StatsSpec(bins=16, range=(-4.0, 4.0))
    fields = split_stats("outputs.0", compute_stats(t, spec).numpy())
    x = t.to(torch.float64).numpy().ravel()
    np.testing.assert_allclose(fields["outputs.0.norm"], np.linalg.norm(x), rtol=1e-12)
    np.testing.assert_allclose(fields["outputs.0.mean"], x.mean(), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(fields["outputs.0.std"], x.std(), rtol=1e-12)
    assert fields["outputs.0.min"] == x.min() and fields["outputs.0.max"] == x.max()
    assert fields["outputs.0.absmax"] == np.abs(x).max()
    hist, _ = np.histogram(np.clip(x, -4, 4), bins=spec.edges)
    np.testing.assert_array_equal(fields["outputs.0.hist"], hist)
    assert fields["outputs.0.hist"].sum() == x.size  # clamped: every element is counted
    assert set(fields) == {f"outputs.0.{s}" for s in SCALAR_STATS} | {"outputs.0.hist"}


def test_empty_tensor_gives_nan_scalars():
    fields = split_stats("f", compute_stats(torch.empty(0, 3), StatsSpec(bins=4)).numpy())
    assert np.isnan(fields["f.norm"]) and fields["f.hist"].sum() == 0


def test_complex_is_summarised_by_magnitude():
    t = torch.tensor([3 + 4j, 0j])
    fields = split_stats("f", compute_stats(t, StatsSpec()).numpy())
    assert fields["f.max"] == 5.0 and fields["f.norm"] == 5.0


@pytest.mark.parametrize("kwargs", [dict(bins=0), dict(range=(1.0, 1.0)), dict(bins=2.5)])
def test_bad_spec_is_rejected(kwargs):
    with pytest.raises(InvalidArgumentError, match="bins"):
        StatsSpec(**kwargs)
