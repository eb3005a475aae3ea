"""A Recorder that ends a sampled step with no record warns once, naming the likely cause: an
empty selection (no handle registered) or handles whose modules were not called in the step."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from hookline.tracker import HookManager, Recorder, select


class Net(nn.Module):
    """An encoder/head model with no ``layers`` (the selection in the tests matches nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        self.head = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def _train(rec: Recorder, model: nn.Module, steps: int, setter: bool = False) -> None:
    for step in range(steps):
        if setter:
            rec.set_step(step)
            model(torch.randn(2, 4)).sum().backward()
        else:
            with rec.step(step):
                model(torch.randn(2, 4)).sum().backward()


def _ours(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if "recorded nothing" in str(w.message)]


def test_empty_selection_warns_once_naming_the_pattern_and_nearby_modules(tmp_path):
    model, mgr = Net(), HookManager()
    rec = Recorder(tmp_path / "r")
    fn = mgr.register_forward_hook(rec.outputs, **select(model, "layers.*"))
    assert "0 modules" in repr(fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(rec, model, 3)
        rec.close()
    ours = _ours(caught)
    assert len(ours) == 1, [str(w.message) for w in caught]
    w = ours[0]
    assert issubclass(w.category, RuntimeWarning)
    text = str(w.message)
    assert "sampled step 0" in text and "no hook handle is registered" in text
    assert "select(Net, 'layers.*') matched no module" in text
    assert "'encoder.0'" in text  # module names near the pattern
    assert w.filename == __file__  # points at the training loop, not at hookline


def test_handles_never_called_are_named(tmp_path):
    model, mgr = Net(), HookManager()
    rec = Recorder(tmp_path / "r", every=2)
    mgr.register_forward_hook(rec.outputs, **select(model, "unused"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(rec, model, 4, setter=True)
        rec.close()
    ours = _ours(caught)
    assert len(ours) == 1
    assert "none of its 1 handle (outputs[unused]) was called" in str(ours[0].message)


def test_last_step_of_a_setter_loop_is_checked_at_close(tmp_path):
    model, mgr = Net(), HookManager()
    rec = Recorder(tmp_path / "r")
    mgr.register_forward_hook(rec.outputs, **select(model, "missing"))
    rec.set_step(0)
    model(torch.randn(2, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec.close()
    assert len(_ours(caught)) == 1
    assert "select(Net, 'missing')" in str(_ours(caught)[0].message)


@pytest.mark.parametrize("case", ["recording", "unsampled", "paused"])
def test_no_warning_when_nothing_is_missing(tmp_path, case):
    model, mgr = Net(), HookManager()
    rec = Recorder(tmp_path / "r", every=2)
    mgr.register_forward_hook(rec.outputs, **select(model, "encoder.*"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if case == "recording":
            _train(rec, model, 4)
        elif case == "unsampled":
            with rec.step(1):  # not sampled (every=2): nothing is expected
                pass
        else:
            with rec.paused(), rec.step(0):  # an evaluation pass, paused on purpose
                model(torch.randn(2, 4))
        summary = rec.close()
    assert _ours(caught) == []
    assert summary.handles["outputs[encoder.0]"].records == (2 if case == "recording" else 0)


def test_a_step_cut_short_by_an_exception_is_not_checked(tmp_path):
    model, mgr = Net(), HookManager()
    rec = Recorder(tmp_path / "r")
    mgr.register_forward_hook(rec.outputs, **select(model, "head"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="data loader failed"), rec.step(0):
            raise RuntimeError("data loader failed")  # before any forward
        rec.set_step(1)
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            rec.close()  # (as the integrations close it while training's exception propagates)
    assert _ours(caught) == []
