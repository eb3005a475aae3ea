"""Handles of runs from different frameworks pair on their module names: a wrapper prefix
dropped automatically (and said), ``rename=`` and ``--map OLD=NEW`` explicit."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _compare_support import mlp, record_model, write_run

from hookline.storage import InvalidArgumentError, compare_runs, open_run
from hookline.storage.compare import align_handles


@pytest.fixture(scope="module")
def framework_runs(tmp_path_factory):
    """The same MLP recorded bare (as the HF Trainer names modules) and held as ``self.model``
    (as a LightningModule does): module names ``fc1`` vs ``model.fc1``."""
    import torch

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.model = inner

        def forward(self, x):
            return self.model(x)

    root = tmp_path_factory.mktemp("frameworks")
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(2, 5, 8, generator=gen) for _ in range(2)]
    bare = record_model(root / "bare", mlp(0), inputs)
    wrapped = record_model(root / "wrapped", Wrapper(mlp(0)), inputs)
    return bare, wrapped


def test_wrapper_prefix_is_dropped_and_said(framework_runs):
    bare, wrapped = framework_runs
    assert set(open_run(wrapped).handles) == {"outputs[model.fc1]", "outputs[model.fc2]"}
    res = compare_runs(bare, wrapped, metrics=["cka", "cosine"])
    assert "run B's module names start with 'model.'" in res.alignment
    assert {r.handle for r in res} == {"outputs[fc1]", "outputs[fc2]"}
    fc1 = res.get("outputs[fc1]")
    assert (fc1.handle_a, fc1.handle_b) == ("outputs[fc1]", "outputs[model.fc1]")
    np.testing.assert_allclose(fc1.values["cosine"], 1.0, atol=1e-12)  # the same model and inputs
    # either order: the prefix is dropped on the side that has it
    back = compare_runs(wrapped, bare, metrics=["cka"])
    assert "run A's module names start with 'model.'" in back.alignment
    assert back.get("outputs[fc2]").handle_a == "outputs[model.fc2]"


def test_explicit_rename_and_no_alignment_when_names_pair(framework_runs):
    bare, wrapped = framework_runs
    res = compare_runs(bare, wrapped, metrics=["cosine"], rename={"model": ""})
    assert res.alignment == "renamed 'model' -> ''" and len(res.problems) == 0
    same = compare_runs(wrapped, wrapped, metrics=["cosine"])
    assert same.alignment is None and {r.handle for r in same} == {"outputs[model.fc1]", "outputs[model.fc2]"}
    # a whole handle id renamed (in the run that has it): fc1 of A against fc2 of B
    cross = compare_runs(bare, wrapped, metrics=["cka", "cosine"], rename={"outputs[model.fc2]": "outputs[fc1]"},
                         handles="outputs[fc1]")
    r = cross.get("outputs[fc1]")
    assert (r.handle_a, r.handle_b) == ("outputs[fc1]", "outputs[model.fc2]") and r.ok
    assert r.values["cosine"][0] < 0.99  # two different layers
    # rules apply to both runs: renaming fc2 to fc1 collides with fc1 in each
    with pytest.raises(InvalidArgumentError, match=r"'outputs\[fc1\]' and 'outputs\[fc2\]' of run A both"):
        compare_runs(bare, bare, rename={"outputs[fc2]": "outputs[fc1]"})


def test_stacked_wrappers_and_the_lightning_prefix_of_a_hf_name(tmp_path):
    xs = [np.random.default_rng(0).standard_normal((6, 4))]
    a = write_run(tmp_path / "a", {"transformer.h.0.mlp": xs, "transformer.h.1.mlp": xs})
    wrapped = "module._orig_mod.transformer.h"
    b = write_run(tmp_path / "b", {f"{wrapped}.0.mlp": xs, f"{wrapped}.1.mlp": xs})
    res = compare_runs(a, b, metrics=["cosine"])
    assert "'module._orig_mod.'" in res.alignment and {r.status for r in res} == {"ok"}
    c = write_run(tmp_path / "c", {"model.transformer.h.0.mlp": xs, "head": xs})  # not every name has it
    al = align_handles(open_run(a), open_run(c))
    assert al.note is None and set(al.a) & set(al.b) == set()
    al = align_handles(open_run(a), open_run(c), {"model.transformer": "transformer"})
    assert al.a["outputs[transformer.h.0.mlp]"] == "outputs[transformer.h.0.mlp]"
    assert al.b["outputs[transformer.h.0.mlp]"] == "outputs[model.transformer.h.0.mlp]"


def test_bad_rename_rules(framework_runs):
    bare, wrapped = framework_runs
    with pytest.raises(InvalidArgumentError, match=r"rename 'decoder' matches no .*model\.fc1"):
        compare_runs(bare, wrapped, rename={"decoder": "x"})
    with pytest.raises(InvalidArgumentError, match=r"both 'outputs\[z\]'"):
        compare_runs(bare, wrapped, rename={"fc1": "z", "fc2": "z"})
    # the prefix must end at a dot: 'mod' is not a prefix of 'model.fc1'
    with pytest.raises(InvalidArgumentError, match="'mod'"):
        compare_runs(bare, wrapped, rename={"mod": ""})


def test_cli_map_and_the_note(framework_runs):
    from click.testing import CliRunner

    from hookline.cli.main import cli

    bare, wrapped = framework_runs
    runner = CliRunner()
    out = runner.invoke(cli, ["compare", str(bare), str(wrapped), "--metric", "cka", "-q"])
    assert out.exit_code == 0 and "note: no handle paired as recorded" in out.output
    js = json.loads(runner.invoke(cli, ["compare", str(bare), str(wrapped), "--map", "model=", "--json"]).output)
    assert js["alignment"] == "renamed 'model' -> ''" and js["results"][0]["handle_b"].startswith("outputs[model.")
    bad = runner.invoke(cli, ["compare", str(bare), str(wrapped), "--map", "model"])
    assert bad.exit_code == 1 and "--map 'model': write OLD=NEW" in bad.output
    none = runner.invoke(cli, ["compare", str(bare), str(wrapped), "--map", "fc1=x", "--map", "fc2=y"])
    assert none.exit_code == 1 and "--map OLD=NEW" in none.output
