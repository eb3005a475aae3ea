"""What `verify --repair` says it did: counts in English (storage/words.py), never "file(s)"."""

from __future__ import annotations

import numpy as np
import pytest

from hookline.storage import RunWriter, verify


def _segments_only(d, records):
    """Handle "a" in one sealed segment per record (a flush seals one) and no final file."""
    with RunWriter(d, merge_on_close=False, fsync=False) as w:
        w.add_handle("a")
        for s in range(records):
            w.write("a", s, 0, {"x": np.full(3, s, np.float32)})
            w.flush()


@pytest.mark.parametrize("records, said", [(1, "merged 1 file into a.h5 (1 record)"),
                                            (3, "merged 3 files into a.h5 (3 records)")])
def test_repair_counts_merged_files_and_records_in_english(tmp_path, records, said):
    d = tmp_path / "r"
    _segments_only(d, records)
    rep = verify(d, repair=True)
    h = next(h for h in rep.handles if h.handle_id == "a")
    assert said in h.repaired, h.repaired
    assert "(s)" not in str(rep), str(rep)
