"""Opening a run of many handles (issue 34, case 6): the manifest is checked in one pass per
handle (a wrong value still named exactly), and ``hookline show`` of a run with more handles
than ``--limit`` lists the first ones and sums up all of them from the manifest, opening only
the listed handles' files. Times are in tests/benchmarks/bench_open.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from hookline.cli.main import cli
from hookline.storage import FormatError, RunWriter, open_run

N = 24


@pytest.fixture
def many(tmp_path):
    run = tmp_path / "run"
    with RunWriter(run, fsync=False) as w:
        for i in range(N):
            w.add_handle(f"outputs[l{i}]", module_name=f"l{i}", category="forward_hook")
            for s in range(i % 3 + 1):
                w.write(f"outputs[l{i}]", s, 0, {"outputs.0": np.full(4, s, np.float32)})
    return run


@pytest.mark.parametrize("key,value,named", [
    ("records", -1, "records"), ("records", True, "records"), ("steps", [0], "steps"),
    ("fields", {"x": {"dtype": "float32", "shape": [1.5], "ndim": 1}}, "fields"), ("module_name", 3, "module_name"),
    ("key", "", "key"), ("meta", [], "meta"), ("lost", [1], "lost"),
])
def test_every_wrong_entry_value_is_still_named(many, key, value, named):
    path = many / "manifest.json"
    m = json.loads(path.read_text())
    m["handles"]["outputs[l7]"][key] = value
    path.write_text(json.dumps(m))
    with pytest.raises(FormatError, match=rf"handles\['outputs\[l7\]'\]\.{named}"):
        open_run(many)


def test_unusual_but_valid_entries_pass(many):
    path = many / "manifest.json"
    m = json.loads(path.read_text())
    m["handles"]["outputs[l3]"]["lost"] = ["records of a file repair moved aside"]
    m["handles"]["outputs[l4]"]["a_future_key"] = {"x": 1}  # (unknown keys are ignored)
    path.write_text(json.dumps(m))
    with open_run(many) as run:
        assert len(run.handles) == N and len(run["outputs[l4]"]) == 2


def test_show_of_many_handles_lists_a_page_and_sums_all(many):
    res = CliRunner().invoke(cli, ["show", str(many), "--limit", "5"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())  # (the title wraps in a narrow terminal)
    assert f"{N} handles, {sum(i % 3 + 1 for i in range(N))} records" in text
    assert "the first 5 listed" in text and f"and {N - 5} more handles" in text
    assert "outputs[l4]" in res.output and "outputs[l5]" not in res.output
    on_disk = sum(p.stat().st_size for p in many.rglob("*.h5"))
    res = CliRunner().invoke(cli, ["show", str(many), "--limit", "5", "--json"])
    data = json.loads(res.output)
    assert [h["handle"] for h in data["handles"]] == [f"outputs[l{i}]" for i in range(5)]
    assert data["total"] == {"handles": N, "records": sum(i % 3 + 1 for i in range(N)), "bytes": on_disk}
    res = CliRunner().invoke(cli, ["show", str(many), "--limit", "0", "--json"])
    assert len(json.loads(res.output)["handles"]) == N and "total" not in json.loads(res.output)
