"""torch.compile: a compiled model (or one holding compiled submodules) records what eager records.

References are plain torch hooks on an eager twin (tests/capture/_training_stacks.py). Forward
captures run inside the compiled graph (``hookline::record`` ops: ``fullgraph=True`` works);
gradient captures make a graph break around each module they hook, on sampled steps only.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.utils as dynamo_utils

from hookline.tracker import HookManager, Recorder

from _training_stacks import MLP, mods, assert_same_records, batches, record_run, recorded, reference, train, twin

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # the eager twin's l1

NAMES = ["l1", "l2", "l3"]
# eager and aot_eager run torch's own kernels: bit-exact; Inductor fuses (gelu, tanh, add)
TOL = {"eager": {}, "aot_eager": {}, "inductor": {"rtol": 1e-5, "atol": 1e-6}}
BACKENDS = [pytest.param("eager"), pytest.param("aot_eager"), pytest.param("inductor", marks=pytest.mark.slow)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    yield
    torch._dynamo.reset()


def _model() -> MLP:
    torch.manual_seed(0)
    return MLP()


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_model_records_what_eager_records(tmp_path, backend):
    """Outputs and gradients (grad_out, grad_in) of every Linear, 3 training steps."""
    model, data = _model(), batches(3)
    want = reference(twin(model), NAMES, data)
    got = record_run(tmp_path / "run", model, NAMES, data, run_model=torch.compile(model, backend=backend))
    assert_same_records(got, want, **TOL[backend])


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_capture_records_inside_the_graph_with_fullgraph(tmp_path, backend):
    """rec.inputs and rec.outputs under fullgraph=True: no graph break at all (Dynamo raises on one)."""
    model, data = _model(), batches(3)
    want = reference(twin(model), NAMES, data, grads=False)
    mgr = HookManager()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with Recorder(tmp_path / "run") as rec:
        mgr.register_forward_hook(rec.outputs, **mods(model, NAMES))
        mgr.register_forward_pre_hook(rec.inputs, **mods(model, ["l2"]))
        train(compiled, data, rec.step, params=model)
    got = recorded(tmp_path / "run")
    inputs = got.pop(("inputs[l2]", "inputs.0"))
    assert_same_records(got, want, **TOL[backend])
    # l2's input is gelu(l1(x)), the reference's l1 output through gelu
    for (s, c, a), (_, _, l1) in zip(inputs, want[("outputs[l1]", "outputs.0")]):
        torch.testing.assert_close(torch.from_numpy(a), torch.nn.functional.gelu(torch.from_numpy(l1)), **(TOL[backend] or {"rtol": 0, "atol": 0}))
    assert dynamo_utils.counters["graph_break"] == {}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_model_holding_compiled_submodules(tmp_path, backend):
    """Submodules compiled in place (``module.compile()``), hooks on them and on a plain one."""
    model, data = _model(), batches(3)
    want = reference(twin(model), NAMES, data)
    model.l1.compile(backend=backend)
    model.l2.compile(backend=backend)
    got = record_run(tmp_path / "run", model, NAMES, data)
    assert_same_records(got, want)
    assert dynamo_utils.counters["stats"]["unique_graphs"] >= 2  # the submodules did compile


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_sampling_under_compile_adds_no_graph_after_two_periods(tmp_path, backend):
    """every=4 over 12 steps: the graphs of a sampled and of a skipped step are compiled in the
    first two periods and reused afterwards (no recompilation per step, no new graph break)."""
    model, data = _model(), batches(12)
    want = reference(twin(model), NAMES, data, every=4)
    compiled = torch.compile(model, backend=backend)
    counts = {}
    mgr = HookManager()
    with Recorder(tmp_path / "run", every=4) as rec:
        mgr.register_forward_hook(rec.outputs, **mods(model, NAMES))
        mgr.register_backward_hook(rec.grads, **mods(model, NAMES))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step, (x, y) in enumerate(data):
            with rec.step(step):
                loss = torch.nn.functional.mse_loss(compiled(x), y)
                opt.zero_grad()
                loss.backward()
            opt.step()
            counts[step] = (dynamo_utils.counters["stats"]["unique_graphs"],
                            sum(dynamo_utils.counters["graph_break"].values()))
    assert_same_records(recorded(tmp_path / "run"), want)
    assert counts[11] == counts[7], counts
    assert counts[7][0] > 0


def test_more_hooked_modules_than_dynamos_recompile_limit(tmp_path):
    """12 Linears with gradient capture (past Dynamo's recompile limit of 8 for the code resumed
    after each module's graph break): still every record, as eager."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(12):
        layers += [torch.nn.Linear(8, 8), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    names = [str(2 * i) for i in range(12)]
    data = [(x, torch.cat([y, y], 1)) for x, y in batches(2)]
    want = reference(twin(model), names, data)
    got = record_run(tmp_path / "run", model, names, data, run_model=torch.compile(model, backend="aot_eager"))
    assert_same_records(got, want)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_first_compiled_step_not_sampled(tmp_path, backend):
    """The model compiles first on a step the recorder does not sample (its hooks are off):
    the sampled steps after it still record (torch's default would reuse the hook-less graph)."""
    model, data = _model(), batches(6)
    want = reference(twin(model), NAMES, data, steps={2, 5})
    got = record_run(tmp_path / "run", model, NAMES, data, steps=[2, 5],
                     run_model=torch.compile(model, backend=backend))
    assert_same_records(got, want)


def test_hooks_registered_after_the_first_compiled_call(tmp_path):
    model, data = _model(), batches(3)
    want = reference(twin(model), NAMES, data)
    compiled = torch.compile(model, backend="aot_eager")
    compiled(data[0][0]).sum().backward()  # compiled (and cached) without hooks
    model.zero_grad()
    assert_same_records(record_run(tmp_path / "run", model, NAMES, data, run_model=compiled), want)


def test_paused_evaluation_before_training(tmp_path):
    """A pass under rec.paused() (grad mode on, as a loss computed for logging) compiles the
    model first; training then records."""
    model, data = _model(), batches(3)
    want = reference(twin(model), NAMES, data)
    compiled = torch.compile(model, backend="aot_eager")
    mgr = HookManager()
    with Recorder(tmp_path / "run") as rec:
        mgr.register_forward_hook(rec.outputs, **mods(model, NAMES))
        mgr.register_backward_hook(rec.grads, **mods(model, NAMES))
        with rec.paused():
            compiled(data[0][0])
        train(compiled, data, rec.step, params=model)
    assert_same_records(recorded(tmp_path / "run"), want)


def test_steps_not_sampled_run_without_graph_breaks(tmp_path):
    """Outputs and grads hooked, no step sampled: the compiled model runs with fullgraph=True."""
    model, data = _model(), batches(3)
    mgr = HookManager()
    with Recorder(tmp_path / "run", steps=[100]) as rec:
        mgr.register_forward_hook(rec.outputs, **mods(model, NAMES))
        mgr.register_backward_hook(rec.grads, **mods(model, NAMES))
        train(torch.compile(model, backend="aot_eager", fullgraph=True), data, rec.step, params=model)
    assert dynamo_utils.counters["graph_break"] == {}


def test_deactivated_hooks_compile_with_fullgraph(tmp_path):
    """Deactivated recorder hooks (also backward ones) leave the model fully compilable, and the
    handles record again once activated."""
    model, data = _model(), batches(2)
    mgr = HookManager()
    with Recorder(tmp_path / "run") as rec:
        outs = mgr.register_forward_hook(rec.outputs, **mods(model, NAMES))
        grads = mgr.register_backward_hook(rec.grads, **mods(model, NAMES))
        for hf in (outs, grads):
            for h in hf.module_to_handle.values():
                h.deactivate()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        train(compiled, data, rec.step, params=model)  # fullgraph: a graph break would raise
        summary_before = rec.summary()
    assert all(h.records == 0 for h in summary_before.handles.values())
    assert dynamo_utils.counters["graph_break"] == {}
