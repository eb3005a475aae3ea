"""``verify`` on a healthy run that a RunWriter is still writing (issue 37, item 2): an open run is
a state, not a problem: exit 0, the run named open, the sealed records counted and the segments
still being written named as pending; ``--repair`` still refuses a live run."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from hookline.cli.main import cli
from hookline.storage import StorageError, verify
from _storage_support import HID, write_std_run


def test_verify_of_a_live_run_is_ok_and_says_open(run_dir):
    w = write_std_run(run_dir, n=12, flush_every=4)  # 3 sealed segments per handle, nothing pending
    try:
        w.write(HID, 99, 0, {"outputs.0": np.zeros((8, 16), np.float32), "outputs.1": np.arange(2)})
        w.write(HID, 100, 0, {"outputs.0": np.zeros((8, 16), np.float32), "outputs.1": np.arange(2)})
        rep = verify(run_dir)
        assert rep.ok and rep.clean and rep.writing, str(rep)
        assert rep.records == 24  # (12 records of each handle, sealed; the two pending ones are not counted)
        text = str(rep)
        assert "OK, OPEN" in text and "24 records sealed" in text and "pending" in text, text

        res = CliRunner().invoke(cli, ["verify", str(run_dir)])
        assert res.exit_code == 0, res.output
        assert "open" in res.output and "--repair" not in res.output, res.output
        res = CliRunner().invoke(cli, ["verify", str(run_dir), "--json"])
        assert res.exit_code == 0 and json.loads(res.output)["writing"] is True

        with pytest.raises(StorageError, match="still writing"):
            verify(run_dir, repair=True)
    finally:
        w.close()
    done = verify(run_dir)
    assert done.clean and not done.writing and done.records == 26 and "OPEN" not in str(done)
