"""Registration, names, lookup tables, activation, contexts, removal and their errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hookline.tracker import (
    DuplicateNameError,
    HookFunction,
    HookManager,
    HooklineError,
    HookTypeError,
    InvalidArgumentError,
    UnknownNameError,
    select,
)


def fwd(module, inputs, outputs):
    return None


def fwd2(module, inputs, outputs):
    return None


def bwd(module, grad_in, grad_out):
    return None


def torch_hooks(module: nn.Module) -> int:
    return sum(len(d) for d in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                                module._backward_pre_hooks))


def test_registration_returns_hook_function_and_fills_tables(mgr):
    a, b = nn.Linear(2, 2), nn.ReLU()
    hf = mgr.register_forward_hook(fwd, a=a, b=b)
    assert isinstance(hf, HookFunction) and hf.name == repr(fwd) and hf.category == "forward_hook"
    assert mgr.name_to_hookfn == {repr(fwd): hf}
    assert mgr.name_to_module == {"a": a, "b": b} and mgr.module_to_name == {a: "a", b: "b"}
    assert list(mgr.name_to_hookhandle) == [f"{fwd!r}[a]", f"{fwd!r}[b]"]
    handle = hf.module_to_handle[a]
    assert handle.name == f"{fwd!r}[a]" and handle.module is a and handle.hook_fn is hf and handle.active
    assert a.name == "a"  # set because Linear has no `name` attribute
    # registering the same function on more modules extends the same HookFunction
    c = nn.Tanh()
    assert mgr.register_forward_hook(fwd, c=c) is hf and set(hf.module_to_handle) == {a, b, c}


def test_positional_modules_get_existing_or_derived_names(mgr):
    a, b, c = nn.Linear(2, 2), nn.Linear(2, 2), nn.ReLU()
    mgr.register_backward_hook(bwd, first=a)
    mgr.register_forward_hook(fwd, a, b, c)
    assert mgr.module_to_name == {a: "first", b: "Linear_0", c: "ReLU_0"}
    d = nn.Linear(2, 2)
    mgr.register_forward_hook(fwd, d)
    assert mgr.module_to_name[d] == "Linear_1"


def test_module_with_own_name_attribute_is_not_overwritten(mgr):
    class Named(nn.Module):
        name = "mine"

        def forward(self, x):
            return x

    m = Named()
    mgr.register_forward_hook(fwd, other=m)
    assert m.name == "mine" and mgr.module_to_name[m] == "other"


def test_two_managers_on_one_module_share_its_name_attribute():
    """The module shows the first manager's name; when that manager lets go, the second one's
    (the attribute was deleted under the second manager's hooks before)."""
    m = nn.Linear(2, 2)
    a, b = HookManager(), HookManager()
    seen = []
    a.register_forward_hook(fwd, first=m)
    b.register_forward_hook(lambda mod, i, o: seen.append(mod.name), second=m)
    m(torch.randn(1, 2))
    a.remove_all_hooks()
    m(torch.randn(1, 2))
    assert seen == ["first", "second"]
    b.remove_all_hooks()
    assert "name" not in m.__dict__


def test_a_name_the_user_set_meanwhile_is_kept(mgr):
    m = nn.Linear(2, 2)
    mgr.register_forward_hook(fwd, lin=m)
    m.name = "renamed by the user"
    mgr.remove_all_hooks()
    assert m.name == "renamed by the user"


def test_default_name_uses_the_callables_repr(mgr):
    class Hook:
        def __repr__(self):
            return "my_hook"

        def __call__(self, module, inputs, outputs):
            return None

    lin = nn.Linear(2, 2)
    mgr.register_forward_hook(Hook(), lin=lin)
    assert list(mgr.name_to_hookhandle) == ["my_hook[lin]"]


def test_deactivated_and_removed_hooks_leave_no_torch_hook(mgr):
    lin = nn.Linear(2, 2)
    hf_f = mgr.register_forward_hook(fwd, lin=lin)
    mgr.register_forward_pre_hook(lambda m, i: None, lin=lin)
    mgr.register_backward_hook(bwd, lin=lin)
    assert torch_hooks(lin) == 2  # one pre-hook and one forward hook serve all handles
    mgr.deactivate_all_hooks()
    assert torch_hooks(lin) == 0
    mgr.activate_all_hooks(category="backward_hook")
    assert torch_hooks(lin) == 2
    mgr.deactivate_all_hooks()
    hf_f.module_to_handle[lin].activate()
    assert len(lin._forward_hooks) == 1 and not lin._forward_pre_hooks
    mgr.remove_all_hooks()
    assert torch_hooks(lin) == 0 and mgr.name_to_hookhandle == {} and mgr.name_to_module == {}
    assert not hasattr(lin, "name")


def test_filters_by_hook_types_in_every_spelling(mgr):
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    hf = mgr.register_forward_hook(fwd, a=a, b=b, activate=False)
    mgr.register_forward_hook(fwd2, hook_fn_name="second", a=a, activate=False)
    for spelling in ([fwd], [hf], [repr(fwd)], fwd, repr(fwd)):
        mgr.activate_all_hooks(hook_types=spelling)
        assert [h.name for h in mgr.name_to_hookhandle.values() if h.active] == [f"{fwd!r}[a]", f"{fwd!r}[b]"]
        mgr.deactivate_all_hooks()
    mgr.activate_module_hooks(a, hook_types=["second"])
    assert [h.name for h in mgr.handles() if h.active] == ["second[a]"]
    mgr.deactivate_module_hooks_by_name("a")
    mgr.activate_module_hooks_by_name("b", category="forward_hook")
    assert [h.name for h in mgr.handles() if h.active] == [f"{fwd!r}[b]"]
    mgr.deactivate_hook_by_name(f"{fwd!r}[b]")
    mgr.activate_hook_by_name("second[a]")
    assert [h.name for h in mgr.handles(a) if h.active] == ["second[a]"]


def test_context_does_nothing_before_enter_and_restores_on_exit(mgr):
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    mgr.register_forward_hook(fwd, a=a, b=b, activate=False)
    mgr.hook_all_context(category="forward_hook")
    assert not any(h.active for h in mgr.handles())
    mgr.activate_module_hooks(b)
    ctx = mgr.hook_module_context(a)
    with ctx:
        assert all(h.active for h in mgr.handles())
    assert [h.active for h in mgr.handles()] == [False, True]
    with pytest.raises(ZeroDivisionError):
        with mgr.hook_all_context():
            assert all(h.active for h in mgr.handles())
            1 / 0
    assert [h.active for h in mgr.handles()] == [False, True]
    with mgr.hook_module_context_by_name("a"):
        pass
    assert not a._forward_hooks and b._forward_hooks


def test_removal_is_idempotent_and_final(mgr):
    lin = nn.Linear(2, 2)
    hf = mgr.register_forward_hook(fwd, lin=lin)
    handle = hf.module_to_handle[lin]
    handle.remove()
    handle.remove()
    assert handle.removed and not handle.active and mgr.name_to_hookhandle == {}
    assert mgr.name_to_hookfn == {} and hf.module_to_handle == {}
    with pytest.raises(InvalidArgumentError, match=r"was removed"):
        handle.activate()
    mgr.activate_all_hooks()
    assert not lin._forward_hooks


def test_handle_as_context_manager_removes_on_exit(mgr):
    lin = nn.Linear(2, 2)
    seen = []
    with mgr.register_forward_hook(lambda m, i, o: seen.append(1), lin=lin).module_to_handle[lin] as handle:
        lin(torch.zeros(1, 2))
    assert seen == [1] and handle.removed and not lin._forward_hooks


def test_remove_by_name_variants(mgr):
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    mgr.register_forward_hook(fwd, a=a, b=b)
    mgr.register_backward_hook(bwd, a=a)
    mgr.remove_hook_function_by_name(repr(bwd))
    assert list(mgr.name_to_hookfn) == [repr(fwd)]
    mgr.remove_module(a)
    assert list(mgr.name_to_module) == ["b"] and not a._forward_hooks
    mgr.remove_hook_by_name(f"{fwd!r}[b]")
    assert mgr.name_to_hookhandle == {} and mgr.name_to_module == {}


def test_bind_protocol_is_called_per_handle(mgr):
    class Capture:
        def __init__(self):
            self.bound, self.unbound = [], []

        def __call__(self, module, inputs, outputs):
            return None

        def _hookline_bind(self, handle):
            self.bound.append(handle.name)

        def _hookline_unbind(self, handle):
            self.unbound.append(handle.name)

        def __repr__(self):
            return "cap"

    cap = Capture()
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    mgr.register_forward_hook(cap, a=a, b=b)
    mgr.remove_module_by_name("a")
    assert cap.bound == ["cap[a]", "cap[b]"] and cap.unbound == ["cap[a]"]


def test_failed_bind_rolls_back_registration(mgr):
    class Refuses:
        def __call__(self, *args):
            return None

        def _hookline_bind(self, handle):
            raise InvalidArgumentError("not as a forward_hook")

    lin = nn.Linear(2, 2)
    with pytest.raises(InvalidArgumentError):
        mgr.register_forward_hook(Refuses(), lin=lin)
    assert mgr.name_to_hookhandle == {} and mgr.name_to_module == {} and not lin._forward_hooks


# --- errors -------------------------------------------------------------------------------

def check_error(exc_info, builtin, *quoted):
    assert isinstance(exc_info.value, HooklineError) and isinstance(exc_info.value, builtin)
    for q in quoted:
        assert q in str(exc_info.value), (q, str(exc_info.value))


def test_error_non_callable_and_non_module(mgr):
    with pytest.raises(HookTypeError) as e:
        mgr.register_forward_hook(42, lin=nn.Linear(2, 2))
    check_error(e, TypeError, "callable", "42")
    with pytest.raises(HookTypeError) as e:
        mgr.register_forward_hook(fwd, lin="not a module")
    check_error(e, TypeError, "'lin'", "str", "not a module")
    with pytest.raises(HookTypeError) as e:
        mgr.register_backward_hook(bwd, torch.zeros(2))
    check_error(e, TypeError, "Tensor")
    with pytest.raises(HookTypeError):
        mgr.activate_module_hooks("lin")
    assert mgr.name_to_hookfn == {}


@pytest.mark.parametrize("call", [
    lambda m: m.activate_all_hooks(category="forward"),
    lambda m: m.deactivate_all_hooks(category="forward"),
    lambda m: m.activate_module_hooks(m.name_to_module["lin"], category="forward"),
    lambda m: m.deactivate_module_hooks_by_name("lin", category="forward"),
    lambda m: m.hook_all_context(category="forward"),
    lambda m: m.hook_module_context(m.name_to_module["lin"], category="forward"),
    lambda m: m.handles(category="forward"),
])
def test_error_unknown_category_everywhere(mgr, call):
    mgr.register_forward_hook(fwd, lin=nn.Linear(2, 2))
    with pytest.raises(InvalidArgumentError) as e:
        call(mgr)
    check_error(e, ValueError, "'forward'", "'forward_hook'", "'backward_hook'", "'forward_pre_hook'", "'all'")


def test_error_unknown_names_suggest_close_matches(mgr):
    mgr.register_forward_hook(fwd, hook_fn_name="outputs", encoder=nn.Linear(2, 2))
    cases = [
        (lambda: mgr.remove_module_by_name("encodr"), "'encodr'", "'encoder'"),
        (lambda: mgr.remove_hook_by_name("outputs[encodr]"), "'outputs[encodr]'", "'outputs[encoder]'"),
        (lambda: mgr.remove_hook_function_by_name("output"), "'output'", "'outputs'"),
        (lambda: mgr.activate_module_hooks_by_name("encodr"), "'encodr'", "'encoder'"),
        (lambda: mgr.deactivate_hook_by_name("outputs[encodr]"), "'outputs[encodr]'", "'outputs[encoder]'"),
        (lambda: mgr.activate_all_hooks(hook_types=["output"]), "'output'", "'outputs'"),
        (lambda: mgr.remove_hook_function(fwd2), "fwd2"),
        (lambda: mgr.activate_module_hooks(nn.ReLU()), "ReLU()", "encoder"),
    ]
    for call, *quoted in cases:
        with pytest.raises(UnknownNameError) as e:
            call()
        check_error(e, KeyError, *quoted)


def test_error_duplicate_names(mgr):
    a, b = nn.Linear(2, 2), nn.ReLU()
    mgr.register_forward_hook(fwd, a=a)
    with pytest.raises(DuplicateNameError) as e:
        mgr.register_forward_hook(fwd2, a=b)  # name 'a' already denotes another module
    check_error(e, ValueError, "'a'", "Linear(in_features=2", "ReLU()")
    with pytest.raises(DuplicateNameError) as e:
        mgr.register_forward_hook(fwd, a=a)  # same function twice on the same module
    check_error(e, ValueError, repr(fwd), "'a'")
    with pytest.raises(DuplicateNameError) as e:
        mgr.register_forward_hook(fwd2, other=a)  # one module, two names
    check_error(e, ValueError, "'a'", "'other'")
    with pytest.raises(DuplicateNameError) as e:
        mgr.register_backward_hook(fwd, b=b)  # one hook function name, two categories
    check_error(e, ValueError, repr(fwd), "forward_hook", "backward_hook")
    with pytest.raises(DuplicateNameError) as e:
        mgr.register_forward_hook(fwd2, hook_fn_name=repr(fwd), b=b)  # one name, two functions
    check_error(e, ValueError, repr(fwd))
    with pytest.raises(DuplicateNameError):
        mgr.register_forward_hook(fwd2, b, x=b)  # one module twice in one call
    assert list(mgr.name_to_hookhandle) == [f"{fwd!r}[a]"]  # failed registrations changed nothing


def test_select_patterns_and_types():
    model = nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.ReLU(), nn.Linear(3, 3)))
    assert list(select(model)) == ["", "0", "1", "1.0", "1.1"]
    assert list(select(model, "1.*")) == ["1.0", "1.1"]
    assert list(select(model, "*", nn.Linear)) == ["0", "1.1"]
    assert list(select(model, "?", (nn.Linear, nn.Sequential))) == ["0", "1"]
    assert select(model, "nothing*") == {}
    with pytest.raises(HookTypeError, match="nn.Module"):
        select("model")
    with pytest.raises(HookTypeError, match="glob"):
        select(model, 3)
    with pytest.raises(HookTypeError, match="types"):
        select(model, "*", "Linear")


def test_leftover_hook_check_reports_hooks():
    from _hook_checks import leftover_hooks

    lin = nn.Linear(2, 2)
    handle = lin.register_forward_hook(fwd)
    try:
        assert leftover_hooks([lin]) and "Linear._forward_hooks" in leftover_hooks([lin])[0]
    finally:
        handle.remove()
    assert leftover_hooks([lin]) == []


def test_a_module_named_fn_can_be_passed_by_keyword(mgr):
    model = nn.Module()
    model.fn = nn.Linear(2, 2)
    mgr.register_forward_hook(fwd, **select(model, "fn"))
    assert list(mgr.name_to_module) == ["fn"]
