"""The run summary page ``hookline/summary.html``: downloaded from a real MLflow server, it names
every handle with its module, fields, shapes, dtypes, records, steps and bytes, and holds
pictures (PNG data URIs) of the values; the run page draws one chart per field (gradients add
their running maximum, which the documented search filter compares)."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from hookline.storage import open_run, sync
from hookline.storage.mlflow.runsummary import write_summary
from hookline.tracker import HookManager, Recorder, select

STEPS = 10
PNG = b"\x89PNG\r\n\x1a\n"


def _record(run_dir: Path, **kw) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    rec = Recorder(run_dir, **kw)
    mgr = HookManager()
    layers = select(model, "*", types=torch.nn.Linear)
    mgr.register_forward_hook(rec.outputs, **layers)
    mgr.register_backward_hook(rec.grads, **layers)
    mgr.register_forward_hook(rec.hook("outputs", mode="stats"), **select(model, "1"))
    for step in range(STEPS):
        with rec.step(step):
            model(torch.randn(4, 8)).pow(2).mean().backward()
    rec.close()


def _pictures(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


def test_summary_downloaded_from_a_real_server_names_every_handle(mlflow_server, tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server)
    rid = client.create_run(client.create_experiment(f"summary-{tmp_path.name}")).info.run_id
    _record(tmp_path / "run", mlflow_run_id=rid, tracking_uri=mlflow_server)
    page = Path(client.download_artifacts(rid, "hookline/summary.html", str(tmp_path / "dl"))).read_text()
    run = open_run(tmp_path / "run")
    assert len(run.handles) == 5
    for hid in run.handles:
        h = run[hid]
        assert f"<h2>{hid}</h2>" in page
        assert f"<code>{h.module_name}</code> ({h.module_type})" in page
        for name in h.fields:
            f = h[name]
            shape = "x".join(map(str, f.shape)) or "scalar"
            assert f"<tr><td>{name}</td><td>{shape}</td><td>{f.torch_dtype_name}</td><td>{len(f)}</td>" in page
    assert "steps 10 (0..9)" in page and "KiB" in page
    pictures = _pictures(page)
    # norm + value strip for each tensor field: 2 outputs.0, 1 grad_in.0 (the input has none),
    # 2 grad_out.0, and the stats handle's outputs.0 (from its .norm and .hist records)
    assert len(pictures) == 2 * 6 and all(p.startswith(PNG) for p in pictures)
    # a second sync finds it current and uploads nothing
    again = sync(tmp_path / "run", rid, tracking_uri=mlflow_server)
    assert again.ok and again.uploaded == [] and again.summary == "hookline/summary.html"


def test_run_page_draws_one_chart_per_field_and_the_gradient_filter_works(sqlite_tracking_uri, tmp_path):
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient(sqlite_tracking_uri)
    rid = client.create_run("0").info.run_id
    _record(tmp_path / "run", mlflow_run_id=rid, tracking_uri=sqlite_tracking_uri)
    metrics = set(client.get_run(rid).data.metrics)
    norms = {k for k in metrics if k.endswith(".norm")}
    maxima = {k for k in metrics if k.endswith(".norm_max")}
    assert len(norms) == 6  # one per field: 3 outputs (one a stats handle), 1 grad_in, 2 grad_out
    assert maxima == {k + "_max" for k in norms if "/grad_" in k}  # the running maximum: gradients only
    grad = open_run(tmp_path / "run")["grads[2]"]["grad_out.0"].norms()
    hits = mlflow.search_runs(experiment_ids=["0"], output_format="list",
                              filter_string=f"metrics.`hookline.grads/2/grad_out.0.norm_max` > {grad.max() * 0.99}")
    assert [r.info.run_id for r in hits] == [rid]
    none = mlflow.search_runs(experiment_ids=["0"], output_format="list",
                              filter_string=f"metrics.`hookline.grads/2/grad_out.0.norm_max` > {grad.max() * 1.01}")
    assert none == []


def test_summary_of_a_large_field_reads_a_bounded_sample(tmp_path, monkeypatch):
    from hookline.storage.mlflow import runsummary

    monkeypatch.setattr(runsummary, "SAMPLE_BYTES", 1 << 20)  # 1 MiB per field
    model = torch.nn.Linear(256, 1024)
    rec = Recorder(tmp_path / "run")
    HookManager().register_forward_hook(rec.outputs, m=model)
    for step in range(20):
        with rec.step(step):
            model(torch.randn(128, 256))  # 512 KiB per record
    rec.close()
    read = []
    field_cls = type(open_run(tmp_path / "run")["outputs[m]"]["outputs.0"])
    original = field_cls.__getitem__
    monkeypatch.setattr(field_cls, "__getitem__", lambda self, i: read.append(i) or original(self, i))
    page = write_summary(tmp_path / "run", tmp_path / "s.html").read_text()
    assert len(read) == 2  # 1 MiB / 512 KiB records: two sampled, not all 20
    assert len(_pictures(page)) == 2
    assert np.all(np.diff(read) > 0)


def test_summary_draws_ragged_int_bool_and_bfloat16_fields(tmp_path):
    from hookline.storage import RunWriter

    rng = np.random.default_rng(0)
    w = RunWriter(tmp_path / "run", fsync=False)
    w.add_handle("outputs[m]", module_name="m")
    for s in range(6):
        bf16 = torch.from_numpy(rng.standard_normal(4).astype(np.float32)).to(torch.bfloat16)
        w.write("outputs[m]", s, 0, {"outputs.0": rng.random((s + 1, 3), dtype=np.float32),  # ragged
                                     "outputs.1": np.arange(s + 2), "outputs.2": np.array([True, s % 2 == 0]),
                                     "outputs.3": (bf16.view(torch.int16).numpy().view(np.uint16), "bfloat16")})
    w.close()
    page = write_summary(tmp_path / "run", tmp_path / "s.html").read_text()
    assert "<tr><td>outputs.0</td><td>ragged</td><td>float32</td><td>6</td>" in page
    assert "<td>bfloat16</td>" in page and "<td>bool</td>" in page
    assert len(_pictures(page)) == 2 * 4
