"""What the MLflow run page shows of a recorded run: every metric chart is a line, tags are few.

The run page draws one chart per metric key; a metric with one point is a chart with a single
dot (``norm_max``/``norm_last`` were). Each handle added ten tags, digests among them; now two (id, records).
docs/img/mlflow-run-*.png are screenshots of such a page.
"""

from __future__ import annotations

import collections

import torch

from hookline.storage.mlflow.runpage import HANDLE_TAGS
from hookline.tracker import HookManager, Recorder, select

STEPS, EVERY = 12, 2


def _record(run_dir, run_id: str, tracking_uri: str) -> None:
    """A demo-like run: an MLP's Linear outputs and gradients, every 2nd of 12 steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(run_dir, every=EVERY, mlflow_run_id=run_id, tracking_uri=tracking_uri)
    mgr = HookManager()
    layers = select(model, "*", types=torch.nn.Linear)
    mgr.register_forward_hook(rec.outputs, **layers)
    mgr.register_backward_hook(rec.grads, **layers)
    for step in range(STEPS):
        with rec.step(step):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
        opt.step()
    rec.close()


def test_every_metric_is_a_line_and_tags_are_few(store, new_run, tmp_path):
    client = new_run.client
    rid = new_run()
    _record(tmp_path / "run", rid, store)
    run = client.get_run(rid)
    keys = sorted(k for k in run.data.metrics if k.startswith("hookline."))
    assert len(keys) >= 8  # 2 layers x (outputs.0, grad_in.0, grad_out.0) minus the input's missing grad_in
    for key in keys:
        points = client.get_metric_history(rid, key)
        assert len(points) == STEPS // EVERY, (key, points)  # a point per recorded step: a line
        assert len({p.step for p in points}) > 1, key
    per_handle = collections.Counter(k.rsplit("/", 1)[0] for k in run.data.tags
                                     if k.startswith("hookline.") and "/" in k)
    assert len(per_handle) == 4, per_handle  # outputs and grads of 2 layers
    assert all(n <= len(HANDLE_TAGS) == 2 for n in per_handle.values()), per_handle
    run_level = [k for k in run.data.tags if k.startswith("hookline.") and "/" not in k]
    assert len(run_level) <= 6, run_level  # version, format_version, handles, bytes, has.Linear
    # readable values: no digests or JSON blobs on the page
    assert all(len(v) <= 64 for k, v in run.data.tags.items() if k.startswith("hookline.")), run.data.tags
