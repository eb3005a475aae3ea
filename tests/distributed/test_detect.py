"""Rank detection and validation without a process group (tracker/capture/distributed.py)."""

import pytest
from torch import nn

from hookline.storage import InvalidArgumentError
from hookline.tracker import Recorder, select
from hookline.tracker.capture.distributed import detect


def test_single_process_defaults():
    info = detect()
    assert info.rank is None and info.world_size is None and not info.collective and info.is_main


def test_world_of_one_is_single_process():
    info = detect(0, 1)
    assert info.rank is None and info.world_size is None


def test_explicit_rank_without_process_group_names_files_by_rank(tmp_path):
    with Recorder(tmp_path / "run", rank=1, world_size=2) as rec:
        assert rec.rank == 1 and rec.world_size == 2
    assert (tmp_path / "run" / "manifest.rank1.json").exists()


@pytest.mark.parametrize("rank, world", [(0, None), (None, 2), (2, 2), (-1, 2), (0, 0)])
def test_bad_rank_arguments(rank, world):
    with pytest.raises(InvalidArgumentError, match="rank"):
        detect(rank, world)


def test_select_looks_through_data_parallel():
    model = nn.Sequential(nn.Linear(2, 2))
    assert list(select(nn.DataParallel(model), "*", types=nn.Linear)) == ["0"]
