"""Recorder edge cases found in review: stats with a cast, failures confined to their handle,
call numbering, pausing vs sampling, one hook under two categories, layouts, bad arguments."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from hookline.storage import HookTypeError, InvalidArgumentError, open_run
from hookline.tracker import HookFunctionError, HookManager, Recorder
from hookline.tracker.capture.packer import RAGGED_RESET
from hookline.tracker.capture.stats import StatsSpec


def recorded_identity(tmp_path, **kwargs):
    """An nn.Identity whose outputs a new Recorder (run tmp_path/'r') records as 'outputs[m]'."""
    m = nn.Identity()
    mgr = HookManager()
    rec = Recorder(tmp_path / "r", **kwargs)
    mgr.register_forward_hook(rec.outputs, m=m)
    return m, mgr, rec


def steps_calls(run, hid):
    h = run[hid]
    return list(zip(h.steps.tolist(), h.calls.tolist()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stats_of_a_cast_capture_are_float64(tmp_path, dtype):
    m = nn.Identity()
    mgr = HookManager()
    rec = Recorder(tmp_path / "r")
    mgr.register_forward_hook(rec.hook("outputs", mode="stats", dtype=dtype), m=m)
    x = torch.linspace(-3, 3, 4097, dtype=torch.float64) * 1000  # fp16 norms would overflow
    with rec.step(0):
        m(x)
    rec.close()
    with open_run(tmp_path / "r") as run:
        h = run[run.handles[0]]
        cast = x.to(dtype).to(torch.float64).numpy()
        assert h["outputs.0.norm"].dtype == np.float64
        assert h["outputs.0.norm"][0] == pytest.approx(float(np.linalg.norm(cast)), rel=1e-12)
        assert h["outputs.0.hist"][0].sum() == 4097  # every element counted, exactly


def test_a_refused_block_loses_no_other_handles_records(tmp_path):
    """A field whose dtype changes (refused by the writer) fails in its own hook, at once, and
    costs no other record: not the other handle's, not the same handle's records around it."""
    a, b = nn.Identity(), nn.Identity()
    mgr = HookManager()
    rec = Recorder(tmp_path / "r")
    mgr.register_forward_hook(rec.outputs, a=a, b=b)
    with rec.step(0):
        a(torch.ones(3))
        b(torch.ones(3))
    rec.flush()
    with rec.step(1):
        a(torch.ones(3))
        with pytest.raises(HookFunctionError, match="outputs.0.*changed dtype from float32 to float64") as ei:
            a(torch.ones(3, dtype=torch.float64))
        assert isinstance(ei.value.__cause__, InvalidArgumentError)
        b(torch.ones(3))
    with rec.step(2):
        a(torch.ones(3))  # used to be lost: the refusal came at this record's hand-over
        b(torch.ones(3))
    rec.close()
    with open_run(tmp_path / "r") as run:
        assert run["outputs[b]"].steps.tolist() == [0, 1, 2]
        assert steps_calls(run, "outputs[a]") == [(0, 0), (1, 0), (2, 0)]


def test_steps_beyond_int64_are_refused(tmp_path):
    rec = Recorder(tmp_path / "r")
    with pytest.raises(InvalidArgumentError, match=r"2\*\*63 - 1"):
        rec.set_step(2**63)
    rec.close()


def test_call_numbers_never_repeat_within_a_step(tmp_path):
    m, mgr, rec = recorded_identity(tmp_path)
    with rec.step(5):
        m(torch.ones(1))
        mgr.remove_hook_function(rec.outputs)  # removed and registered again inside the step
        mgr.register_forward_hook(rec.outputs, m=m)
        m(torch.ones(1))
    with rec.step(3):
        m(torch.ones(1))
    with rec.step(5):  # a step number entered again
        m(torch.ones(1))
    rec.close()
    with open_run(tmp_path / "r") as run:
        assert steps_calls(run, "outputs[m]") == [(5, 0), (5, 1), (3, 0), (5, 2)]


def test_paused_and_sampling_win_over_handle_state(tmp_path):
    m, mgr, rec = recorded_identity(tmp_path, every=2)
    rec.set_step(0)
    m(torch.ones(2))
    with rec.paused():
        rec.set_step(1)  # e.g. an evaluation loop advancing the counter
    m(torch.ones(2))  # step 1 is not sampled
    rec.set_step(3)
    m2 = nn.Identity()
    with rec.paused():
        rec.set_step(4)  # sampled, but paused
        m(torch.ones(2))
        mgr.register_forward_hook(rec.outputs, m2=m2)  # registered while paused
        m2(torch.ones(2))
    rec.set_step(5)
    mgr.activate_all_hooks()  # by hand, on a step that is not sampled
    m(torch.ones(2))
    m2(torch.ones(2))
    rec.set_step(6)
    m(torch.ones(2))
    m2(torch.ones(2))
    rec.close()
    with open_run(tmp_path / "r") as run:
        assert run["outputs[m]"].steps.tolist() == [0, 6]
        assert run["outputs[m2]"].steps.tolist() == [6]


def test_inputs_hook_as_pre_and_forward_hook_of_one_module(tmp_path):
    m = nn.Linear(2, 2)
    mgr = HookManager()
    rec = Recorder(tmp_path / "r")
    mgr.register_forward_pre_hook(rec.inputs, m=m)
    mgr.register_forward_hook(rec.inputs, hook_fn_name="inputs_post", m=m)
    with rec.step(0):
        m(torch.ones(1, 2))
    summary = rec.close()
    assert {k: v.records for k, v in summary.handles.items()} == {"inputs[m]": 1, "inputs_post[m]": 1}


@pytest.mark.parametrize("make, what", [
    (lambda: torch.eye(3).to_sparse(), "sparse_coo"),
    (lambda: torch.eye(3).to_sparse_csr(), "sparse_csr"),
    (lambda: torch.empty(3, device="meta"), "meta"),
    (lambda: torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8), "quantized"),
])
def test_unsupported_layouts_raise_in_the_hook(tmp_path, make, what):
    m, mgr, rec = recorded_identity(tmp_path)
    with rec.step(0):
        m(torch.ones(3))
        with pytest.raises(HookFunctionError) as info:
            m(make())
    assert isinstance(info.value.__cause__, HookTypeError)
    assert what in str(info.value.__cause__) and "'outputs.0'" in str(info.value.__cause__)
    rec.close()
    with open_run(tmp_path / "r") as run:
        assert run["outputs[m]"].steps.tolist() == [0]  # the good record is kept


def test_scalar_records_read_back_as_scalars(tmp_path):
    m, mgr, rec = recorded_identity(tmp_path)
    with rec.step(0):
        m(torch.tensor(2.5))
    rec.close()
    with open_run(tmp_path / "r") as run:
        t = run["outputs[m]"]["outputs.0"].to_torch(0)
        assert t.shape == () and t.item() == 2.5


def test_a_handle_is_ragged_only_while_its_shape_changes(tmp_path):
    """One short batch per epoch must not leave a handle on one-record blocks for good."""
    m, mgr, rec = recorded_identity(tmp_path)
    blocks: list[int] = []
    real = rec._packer._write_block
    rec._packer._write_block = lambda hid, steps, calls, fields: (blocks.append(len(steps)), real(hid, steps, calls, fields))[1]
    step = 0
    for batch in (8, 8, 3, 8, 3):  # two short batches: ragged
        with rec.step(step):
            m(torch.ones(batch, 4))
        step += 1
    for _ in range(RAGGED_RESET + 40):
        with rec.step(step):
            m(torch.ones(8, 4))
        step += 1
    rec.close()
    assert max(blocks[-3:]) > 1, blocks[-10:]  # full blocks again
    with open_run(tmp_path / "r") as run:
        assert run["outputs[m]"].steps.tolist() == list(range(step))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"max_buffer_mb": float("inf")}, InvalidArgumentError, "max_buffer_mb"),
    ({"max_buffer_mb": "512"}, HookTypeError, "max_buffer_mb must be a number of MB, got str '512'"),
    ({"every": "2"}, HookTypeError, "every must be an int .*got str '2'"),
    ({"steps": 5}, HookTypeError, "iterable.*got int 5"),
    ({"steps": [1, 2.0]}, HookTypeError, "step must be an int, got float 2.0"),
    ({"steps": [1, 2**63]}, InvalidArgumentError, "2\\*\\*63"),
    ({"stats": "x"}, HookTypeError, "StatsSpec"),
    ({"meta": {"every": 7}}, InvalidArgumentError, "meta key 'every' is written by the recorder.*'user_every'"),
    ({"meta": {"opt": object()}}, HookTypeError, "value of 'opt' .*cannot be stored as JSON"),
    ({"meta": [("lr", 0.1)]}, HookTypeError, "meta must be a dict"),
    ({"compression": "gzip-99"}, InvalidArgumentError, "'gzip-99': the gzip level must be an integer from 0 to 9"),
    ({"compression": "zstd-abc"}, InvalidArgumentError, "'zstd-abc': the zstd level"),
    ({"compression": "lzf-3"}, InvalidArgumentError, "lzf has no level"),
    ({"mlflow_run_id": "not an id!"}, InvalidArgumentError, "MLflow run id 'not an id!' is not valid"),
    ({"mlflow_run_id": 123}, HookTypeError, "mlflow_run_id must be a str or None, got int 123"),
    ({"tracking_uri": 5}, HookTypeError, "tracking_uri must be a str or None, got int 5"),
    ({"compression": 5}, HookTypeError, "compression must be None, a name .*got int 5"),
    ({"meta": {"x": {1, 2}}}, HookTypeError, "value of 'x' \\(set"),
])
def test_bad_recorder_arguments(tmp_path, kwargs, error, match):
    """Refused before anything is created: the same directory works at once with good arguments
    (a refused MLflow run id used to leave the run directory locked by a live writer)."""
    with pytest.raises(error, match=match):
        Recorder(tmp_path / "r", **kwargs)
    assert not (tmp_path / "r").exists()
    Recorder(tmp_path / "r").close()


def test_numpy_ints_and_json_like_meta_are_taken(tmp_path):
    rec = Recorder(tmp_path / "r", every=np.int64(2), max_buffer_mb=np.int64(64), meta={"lr": np.float32(0.5), "sizes": np.arange(3),
                                                           "t": torch.tensor(1.5), "nested": {"a": [1, None]}})
    assert rec.every == 2 and type(rec.every) is int
    rec.close()
    with open_run(tmp_path / "r") as run:
        assert run.meta["lr"] == 0.5 and run.meta["sizes"] == [0, 1, 2] and run.meta["t"] == 1.5
        assert run.meta["nested"] == {"a": [1, None]} and run.meta["every"] == 2


@pytest.mark.parametrize("call, error, match", [
    (lambda rec: rec.set_step(1.0), HookTypeError, "step must be an int, got float 1.0"),
    (lambda rec: rec.set_step(torch.tensor(3)), HookTypeError, "step must be an int, got Tensor"),
    (lambda rec: rec.set_step(-1), InvalidArgumentError, "non-negative"),
    (lambda rec: rec.hook("outputs", batch_slice="4"), HookTypeError, "batch_slice must be an int.*got str '4'"),
    (lambda rec: rec.hook("outputs", batch_slice=0), InvalidArgumentError, "positive"),
    (lambda rec: rec.hook("outputs", dtype="bfloat16"), HookTypeError, "torch dtype .*got str 'bfloat16'"),
    (lambda rec: rec.hook("outputs", dtype=torch.int8), InvalidArgumentError, "floating"),
    (lambda rec: rec.hook(5), HookTypeError, "capture kind must be a str, got int 5"),
    (lambda rec: rec.hook("outputs", mode=5), HookTypeError, "capture mode must be a str, got int 5"),
    (lambda rec: rec.hook("outputs", name=5), HookTypeError, "hook name must be a str, got int 5"),
    (lambda rec: rec.hook("outputz"), InvalidArgumentError, "unknown capture kind 'outputz'"),
])
def test_bad_types_are_type_errors_and_bad_values_value_errors(tmp_path, call, error, match):
    rec = Recorder(tmp_path / "r")
    with pytest.raises(error, match=match):
        call(rec)
    rec.close()


def test_a_directory_holding_a_run_is_refused_unless_resumed(tmp_path):
    from hookline.storage import RunExistsError

    m, mgr, rec = recorded_identity(tmp_path)
    with rec.step(0):
        m(torch.ones(1))
    rec.close()
    with pytest.raises(RunExistsError, match="already holds a run .*resume=True") as ei:
        Recorder(tmp_path / "r")
    assert isinstance(ei.value, FileExistsError)
    rec = Recorder(tmp_path / "r", resume=True)
    mgr.register_forward_hook(rec.outputs, m=m)
    with rec.step(1):
        m(torch.ones(1))
    rec.close()
    with open_run(tmp_path / "r") as run:
        assert steps_calls(run, "outputs[m]") == [(0, 0), (1, 0)]


@pytest.mark.parametrize("first, second", [(None, 2), (2, None), (2, 3), (None, "no manifest")])
def test_a_directory_holding_a_run_of_another_rank_layout_is_refused(tmp_path, first, second):
    """A single-process run and a distributed one (or one of another world size) are not mixed,
    nor is a run whose manifest is gone (its handle files would be continued)."""
    from hookline.storage import RunExistsError

    def record(world):
        kw = {"rank": 0, "world_size": world} if isinstance(world, int) else {}
        m, mgr, rec = recorded_identity(tmp_path, **kw)
        with rec.step(0):
            m(torch.ones(1))
        rec.close()

    record(first)
    if second == "no manifest":
        (tmp_path / "r" / "manifest.json").unlink()
    with pytest.raises(RunExistsError, match="already holds a run"):
        record(second)


def test_ranks_of_one_run_starting_at_different_times_are_not_refused(tmp_path):
    from hookline.storage import RunExistsError

    recs = []
    for rank in range(2):  # rank 0 has flushed its manifest when rank 1 starts
        m, mgr, rec = recorded_identity(tmp_path, rank=rank, world_size=2)
        with rec.step(0):
            m(torch.ones(1))
        rec.flush()
        recs.append(rec)
    for rec in recs:
        rec.close()
    with open_run(tmp_path / "r") as run:
        assert run.ranks == [0, 1]
    with pytest.raises(RunExistsError, match="recorded with world_size=2"):
        Recorder(tmp_path / "r", rank=2, world_size=3)


def test_a_hook_name_reused_with_other_options_is_refused(tmp_path):
    """Its records would be mixed into the handle under the first registration's metadata."""
    m = nn.Identity()
    mgr = HookManager()
    rec = Recorder(tmp_path / "r")
    mgr.register_forward_hook(rec.hook("outputs", mode="stats", name="o"), m=m)
    with rec.step(0):
        m(torch.ones(2))
    mgr.remove_all_hooks()
    with pytest.raises(InvalidArgumentError, match=r"handle 'o\[m\]' already records with mode='stats'.*mode='tensor'"):
        mgr.register_forward_hook(rec.hook("outputs", name="o"), m=m)
    mgr.register_forward_hook(rec.hook("outputs", mode="stats", name="o"), m=m)  # the same options: continues
    with rec.step(1):
        m(torch.ones(2))
    rec.close()
    with open_run(tmp_path / "r") as run:
        assert steps_calls(run, "o[m]") == [(0, 0), (1, 0)]


@pytest.mark.parametrize("kwargs", [
    {"range": (0, float("inf"))}, {"range": (-1e308, 1e308)}, {"range": "ab"}, {"range": (1,)},
    {"range": None}, {"bins": True}, {"bins": 0},
])
def test_bad_stats_spec(kwargs):
    with pytest.raises(InvalidArgumentError, match="StatsSpec"):
        StatsSpec(**kwargs)


def test_more_hooked_modules_than_the_open_file_limit_are_all_recorded(tmp_path):
    """80 handles under `ulimit -n 96` (the writer may keep 16 files open): every record lands
    and equals what the model computed, one file per handle."""
    import subprocess
    import sys
    import textwrap

    d = tmp_path / "run"
    child = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (96, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        import torch
        from hookline.tracker import HookManager, Recorder
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(40)])
        mgr = HookManager()
        rec = Recorder({str(d)!r})
        mods = dict(model.named_children())
        mgr.register_forward_hook(rec.outputs, **mods)
        mgr.register_backward_hook(rec.grads, **mods)
        for step in range(3):
            with rec.step(step):
                model(torch.full((2, 8), float(step))).sum().backward()
        rec.close()
        with torch.no_grad():
            torch.save(model(torch.full((2, 8), 2.0)), {str(tmp_path / "last.pt")!r})
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(list(d.rglob("*.h5"))) == 80 and not list(d.rglob("*.h5seg*"))
    run = open_run(d)
    assert len(run.handles) == 80
    assert all(len(run[h]) == 3 for h in run.handles)
    last = torch.load(tmp_path / "last.pt")
    np.testing.assert_array_equal(run["outputs[39]"]["outputs.0"][2], last.numpy())


def test_nested_step_restores_the_outer_step_and_its_sampling(tmp_path):
    lin = nn.Linear(2, 2)
    mgr = HookManager()
    rec = Recorder(tmp_path / "r", every=2)
    mgr.register_forward_hook(rec.outputs, lin=lin)
    mgr.register_backward_hook(rec.grads, lin=lin)
    with rec.step(2):
        with rec.step(3):  # not sampled: suspends the handles for the inner block only
            lin(torch.zeros(2))
        assert rec.current_step == 2
        lin(torch.zeros(2)).sum().backward()  # recorded under the outer step
    with rec.step(4):
        y = lin(torch.zeros(2, requires_grad=True))
        with rec.step(4):
            pass
        y.sum().backward()  # failed before: "fired outside any recorder step"
    assert rec.current_step is None
    rec.close()
    with open_run(tmp_path / "r") as run:
        assert steps_calls(run, "outputs[lin]") == [(2, 0), (4, 0)]
        assert steps_calls(run, "grads[lin]") == [(2, 0), (4, 0)]


def test_a_handle_the_user_deactivates_on_a_skipped_step_stays_off(tmp_path):
    lin = nn.Linear(2, 2)
    mgr = HookManager()
    rec = Recorder(tmp_path / "r", every=2)
    mgr.register_forward_hook(rec.outputs, lin=lin)
    handle = mgr.name_to_hookhandle["outputs[lin]"]
    for s in range(6):
        with rec.step(s):
            assert handle.suspended == (s % 2 == 1)
            if s == 1:
                mgr.deactivate_hook_by_name("outputs[lin]")
            lin(torch.zeros(2))
    assert not handle.active and not lin._forward_hooks  # nothing left on the module either
    with rec.paused():  # and a handle switched on inside paused() waits for the pause to end
        handle.activate()
        assert handle.active and handle.suspended and not handle.runs and not lin._forward_hooks
    assert handle.active and handle.suspended  # step 5 was not sampled: held off until step 6
    rec.set_step(6)
    assert handle.runs
    lin(torch.zeros(2))
    rec.close()
    with open_run(tmp_path / "r") as run:
        assert steps_calls(run, "outputs[lin]") == [(0, 0), (6, 0)]


def test_deactivating_inside_paused_is_kept_after_the_pause(tmp_path):
    m, mgr, rec = recorded_identity(tmp_path)
    handle = mgr.name_to_hookhandle["outputs[m]"]
    with rec.paused():
        assert handle.active and handle.suspended
        handle.deactivate()
    assert not handle.active and not handle.suspended
    with rec.step(0):
        m(torch.ones(1))
    rec.close()
    with open_run(tmp_path / "r") as run:
        assert steps_calls(run, "outputs[m]") == []


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("out", [
    lambda: {"a.b": torch.ones(2), "a": {"b": torch.full((2,), 2.0)}},
    lambda: {0: torch.ones(2), "0": torch.full((2,), 2.0)},
])
def test_two_tensors_named_alike_are_refused_in_the_hook(tmp_path, out):
    """Both would be stored as one field: the second used to overwrite the first, silently."""
    m = _Fn(lambda x: out())
    mgr = HookManager()
    rec = Recorder(tmp_path / "r")
    mgr.register_forward_hook(rec.outputs, m=m)
    with rec.step(0), pytest.raises(HookFunctionError, match=r"both be stored as field 'outputs\.(a\.b|0)'.*rename"):
        m(torch.zeros(1))
    rec.close()


def test_a_bad_field_name_fails_at_its_first_firing_and_costs_no_other_record(tmp_path):
    m = _Fn(lambda x: {"ok": torch.ones(2), "a/b": torch.ones(2)})
    lin = nn.Linear(2, 2)
    mgr = HookManager()
    rec = Recorder(tmp_path / "r")
    mgr.register_forward_hook(rec.outputs, m=m, lin=lin)
    for s in range(3):
        with rec.step(s):
            with pytest.raises(HookFunctionError, match=r"handle 'outputs\[m\]': invalid field name 'outputs\.a/b'"):
                m(torch.zeros(1))
            lin(torch.zeros(2))
    rec.close()  # used to fail here, with every record of outputs[m] lost
    with open_run(tmp_path / "r") as run:
        assert run["outputs[lin]"].steps.tolist() == [0, 1, 2]


def test_flush_writes_the_other_handles_when_one_block_is_refused(tmp_path):
    """A block refused at hand-over (the early check switched off here to get one) must not keep
    the other handles' records from the disk: flush() is the durability barrier."""
    m = _Fn(lambda x: {"ok": torch.ones(2), "a/b": torch.ones(2)})
    lin = nn.Linear(2, 2)
    mgr = HookManager()
    rec = Recorder(tmp_path / "r")
    rec._packer._check_fields = None
    mgr.register_forward_hook(rec.outputs, bad=m, good=lin)
    for s in range(3):
        with rec.step(s):
            m(torch.zeros(1))
            lin(torch.zeros(2))
    with pytest.raises(InvalidArgumentError, match="a/b"):
        rec.flush()
    with open_run(tmp_path / "r") as run:  # the published segments, writer still open
        assert run["outputs[good]"].steps.tolist() == [0, 1, 2]
    rec.close()


def test_a_record_racing_close_is_written_or_refused_never_lost(tmp_path):
    import threading
    import time

    for trial in range(5):
        lin = nn.Linear(2, 2)
        mgr = HookManager()
        rec = Recorder(tmp_path / f"r{trial}")
        mgr.register_forward_hook(rec.outputs, lin=lin)
        accepted = [0]
        capture = rec._bindings.record

        def counted(*a, capture=capture):
            capture(*a)  # raises when the record is refused
            accepted[0] += 1

        rec._bindings.record = counted
        rec.set_step(0)
        stop = threading.Event()

        def work():
            x = torch.zeros(2)
            while not stop.is_set():
                try:
                    lin(x)
                except HookFunctionError:
                    pass

        t = threading.Thread(target=work)
        t.start()
        time.sleep(0.03)
        rec.close()
        stop.set()
        t.join()
        with open_run(tmp_path / f"r{trial}") as run:
            assert len(run["outputs[lin]"].steps) == accepted[0] > 0


def test_a_recorder_dropped_without_close_still_writes_its_records(tmp_path, caplog):
    import gc
    import threading

    def train():
        lin = nn.Linear(2, 2)
        mgr = HookManager()
        rec = Recorder(tmp_path / "r")
        mgr.register_forward_hook(rec.outputs, lin=lin)
        for s in range(10):
            with rec.step(s):
                lin(torch.zeros(2))
        mgr.remove_all_hooks()  # the last references to the recorder go with the function

    train()
    gc.collect()
    for t in threading.enumerate():
        if t.name == "hookline-recorder-finalizer":
            t.join(30)
    with open_run(tmp_path / "r") as run:
        assert run["outputs[lin]"].steps.tolist() == list(range(10))
        assert run.status == "closed"
    assert "garbage-collected without close()" in caplog.text


@pytest.mark.parametrize("second", ["other manager", "other name"])
def test_one_recorder_hook_twice_on_a_module_is_refused(tmp_path, second):
    """Its firings cannot be told apart: they used to land under the second handle, and removing
    it broke the first."""
    lin = nn.Linear(2, 2)
    mgr = HookManager()
    rec = Recorder(tmp_path / "r")
    mgr.register_forward_hook(rec.outputs, lin=lin)
    other = HookManager() if second == "other manager" else mgr
    kw = {"hook_fn_name": "outputs2"} if second == "other name" else {}
    with pytest.raises(InvalidArgumentError, match=r"already registered on this module as 'outputs\[lin\]'.*rec.hook\('outputs', name='outputs2'\)"):
        other.register_forward_hook(rec.outputs, lin=lin, **kw)
    assert len(lin._forward_hooks) == 1  # rolled back: only the first manager's torch hook
    other.register_forward_hook(rec.hook("outputs", name="outputs2"), lin=lin)  # the way that works
    with rec.step(0):
        lin(torch.zeros(2))
    other.remove_hook_function(other.name_to_hookfn["outputs2"])
    with rec.step(1):
        lin(torch.zeros(2))
    rec.close()
    with open_run(tmp_path / "r") as run:
        assert steps_calls(run, "outputs[lin]") == [(0, 0), (1, 0)]
        assert steps_calls(run, "outputs2[lin]") == [(0, 0)]


def test_long_steps_are_summarised_in_the_metadata(tmp_path):
    rec = Recorder(tmp_path / "r", steps=range(0, 10**6, 10))
    assert rec.is_sampled(999_990) and not rec.is_sampled(5)
    rec.close()
    short = Recorder(tmp_path / "s", steps=[7, 3, 5])
    short.close()
    with open_run(tmp_path / "r") as run, open_run(tmp_path / "s") as s:
        assert run.meta["steps"] == {"count": 100_000, "first": 0, "last": 999_990, "stride": 10}
        assert s.meta["steps"] == [3, 5, 7]
    assert (tmp_path / "r" / "manifest.json").stat().st_size < 10_000  # was 0.8 MB, in every file too


def test_two_models_naming_modules_alike_cannot_share_a_handle(tmp_path):
    """A teacher and a student (or a model and its EMA copy) hooked through two managers: their
    modules are both named '0', and one handle 'outputs[0]' would mix their records."""
    from hookline.storage import DuplicateNameError

    teacher, student = nn.Sequential(nn.Linear(4, 8)), nn.Sequential(nn.Linear(4, 8))
    mt, ms = HookManager(), HookManager()
    rec = Recorder(tmp_path / "r")
    mt.register_forward_hook(rec.outputs, **{"0": teacher[0]})
    with pytest.raises(DuplicateNameError, match=r"'outputs\[0\]' already records another module.*"
                                                 r"rec.hook\('outputs', name='student_outputs'\)") as ei:
        ms.register_forward_hook(rec.outputs, **{"0": student[0]})
    assert isinstance(ei.value, ValueError)
    assert not student[0]._forward_hooks  # rolled back
    ms.register_forward_hook(rec.hook("outputs", name="student"), **{"0": student[0]})
    mt.remove_all_hooks()
    mt.register_forward_hook(rec.outputs, **{"0": teacher[0]})  # the same module again: continues
    x = torch.randn(3, 4)
    with rec.step(0):
        teacher(x), student(x)
    rec.close()
    with open_run(tmp_path / "r") as run:
        assert sorted(run.handles) == ["outputs[0]", "student[0]"]
        np.testing.assert_array_equal(run["outputs[0]"]["outputs.0"][0], teacher(x).detach().numpy())
        np.testing.assert_array_equal(run["student[0]"]["outputs.0"][0], student(x).detach().numpy())


class _DictOnce(nn.Module):
    """First call: a dict with a key the writer refuses ('/'); later calls: a valid float16 dict."""

    def __init__(self):
        super().__init__()
        self.first = True

    def forward(self, x):
        if self.first:
            self.first = False
            return {"logits": x.float(), "a/b": x.float()}
        return {"logits": x.half()}


def test_a_refused_record_leaves_no_field_registered(tmp_path):
    """Fields checked before the bad one used to be registered: 'logits' kept float32 from a
    record that was never written, and every later (valid, float16) record was refused."""
    m = _DictOnce()
    mgr = HookManager()
    rec = Recorder(tmp_path / "r")
    mgr.register_forward_hook(rec.outputs, m=m)
    with rec.step(0), pytest.raises(HookFunctionError, match="invalid field name 'outputs.a/b'"):
        m(torch.ones(2))
    for s in (1, 2):
        with rec.step(s):
            m(torch.ones(2))
    rec.close()
    with open_run(tmp_path / "r") as run:
        h = run["outputs[m]"]
        assert h.steps.tolist() == [1, 2] and h["outputs.logits"].dtype == np.float16


def test_on_disk_counts_this_session_of_a_resumed_run(tmp_path):
    for first, n in ((0, 10), (10, 3)):
        m, mgr, rec = recorded_identity(tmp_path, resume=first > 0)
        for s in range(first, first + n):
            with rec.step(s):
                m(torch.ones(2))
        h = rec.close().handles["outputs[m]"]
        assert h.records == h.on_disk == n
    with open_run(tmp_path / "r") as run:
        assert len(run["outputs[m]"]) == 13


def test_a_recorder_collected_at_interpreter_exit_writes_its_records(tmp_path):
    """Collected by an exit hook that runs gc (as some libraries' do): threading has shut down,
    so the finalizer's thread used to race the writer's exit closer and lose the open blocks."""
    import json
    import subprocess
    import sys

    code = f"""
import atexit, gc, torch
from hookline.tracker import HookManager, Recorder
def train():
    m = torch.nn.Linear(16, 16); mgr = HookManager()
    rec = Recorder({str(tmp_path / 'r')!r})
    mgr.register_forward_hook(rec.outputs, fc=m)
    for s in range(50):
        with rec.step(s): m(torch.randn(4, 16))
    mgr.remove_all_hooks()  # close() forgotten: the recorder is garbage, kept by a cycle
gc.disable()
train()
atexit.register(gc.collect)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "garbage-collected without close()" in p.stderr
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert manifest["status"] == "closed" and manifest["handles"]["outputs[fc]"]["records"] == 50
    with open_run(tmp_path / "r") as run:
        assert run["outputs[fc]"].steps.tolist() == list(range(50))


@pytest.mark.parametrize("bad", [-1, 0, float("inf"), "soon", True])
def test_a_bad_mlflow_timeout_is_refused_without_mlflow_too(tmp_path, bad):
    """``mlflow_timeout`` is checked when the Recorder is built, MLflow or not, and nothing is
    created."""
    from hookline.storage.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="mlflow_timeout must be a positive number"):
        Recorder(tmp_path / "run", mlflow_timeout=bad)
    assert not (tmp_path / "run").exists()
