"""Every example of the TackleBox README (shared/seeds/tacklebox-readme.txt), run unchanged.

Only the import line differs (``hookline.tracker`` instead of ``tacklebox.hook_management``);
the code between the ``# --- README`` markers is copied verbatim.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hookline.tracker import HookFunction, HookHandle
from hookline.tracker import HookManager as _HookManager


# --- README: hook functions ---
def my_forward_hook(module, inputs, outputs):
    print('Finished forward pass for module %s' % module.name)
    return outputs


def my_forward_pre_hook(module, inputs):
    print('Beginning forward pass for module %s' % module.name)
    return inputs


def my_backward_hook(module, grad_in, grad_out):
    print('Finished backward pass for module %s' % module.name)
# --- end README


@pytest.fixture
def env():
    """Two modules in a model, a manager, and cleanup (the README keeps no other references)."""
    my_module, other_module = nn.Linear(3, 3), nn.Linear(3, 3)
    model = nn.Sequential(my_module, nn.Tanh(), other_module)
    managers = []

    class HookManager(_HookManager):  # noqa: N801 - same name as in the README
        def __init__(self):
            super().__init__()
            managers.append(self)

    yield HookManager, model, my_module, other_module
    for m in managers:
        m.remove_all_hooks()


def run(model):
    x = torch.randn(2, 3, requires_grad=True)
    model(x).sum().backward()


def test_register_all_three_kinds(env, capsys):
    HookManager, model, my_module, other_module = env
    more_named_modules = {}
    # --- README
    hookmngr = HookManager()
    # register a forward hook on my_module, other_module, etc.
    hookmngr.register_forward_hook(my_forward_hook,
                                   my_module_name=my_module,
                                   other_module_name=other_module,
                                   **more_named_modules)
    # register a forward pre-hook on my_module, other_module, etc.
    hookmngr.register_forward_pre_hook(my_forward_pre_hook,
                                       my_module_name=my_module,
                                       other_module_name=other_module,
                                       **more_named_modules)
    # register a backward hook on my_module, other_module, etc.
    hookmngr.register_backward_hook(my_backward_hook,
                                    my_module_name=my_module,
                                    other_module_name=other_module,
                                    **more_named_modules)
    # --- end README
    run(model)
    assert capsys.readouterr().out.splitlines() == [
        "Beginning forward pass for module my_module_name",
        "Finished forward pass for module my_module_name",
        "Beginning forward pass for module other_module_name",
        "Finished forward pass for module other_module_name",
        "Finished backward pass for module other_module_name",
        "Finished backward pass for module my_module_name",
    ]


def test_register_inactive_then_filters(env, capsys):
    HookManager, model, my_module, other_module = env
    more_modules = []
    hookmngr = HookManager()
    # --- README
    hookmngr.register_forward_hook(my_forward_hook, my_module_name=my_module,
                                   activate=False)
    # --- end README
    hookmngr.register_forward_hook(my_forward_hook, other_module_name=other_module, activate=False)
    hookmngr.register_backward_hook(my_backward_hook, my_module_name=my_module, activate=False)
    run(model)
    assert capsys.readouterr().out == ""

    def fired():
        run(model)
        return capsys.readouterr().out.count("Finished")

    # --- README
    # activate/deactivate all hooks
    hookmngr.activate_all_hooks()
    # --- end README
    assert fired() == 3
    # --- README
    hookmngr.deactivate_all_hooks()
    # --- end README
    assert fired() == 0
    # --- README
    # filter by module:
    # activate/deactivate all hooks registered to my_module, other_module, etc.
    hookmngr.activate_module_hooks(my_module, other_module, *more_modules)
    # --- end README
    assert fired() == 3
    # --- README
    hookmngr.deactivate_module_hooks(my_module, other_module, *more_modules)
    # --- end README
    assert fired() == 0
    # --- README
    # filter by function:
    # activate/deactivate my_forward_hook on all modules it's been registered with
    hookmngr.activate_all_hook(hook_types=[my_forward_hook])
    # --- end README
    assert fired() == 2
    # --- README
    hookmngr.deactivate_all_hooks(hook_types=[my_forward_hook])
    # --- end README
    assert fired() == 0
    # --- README
    # filter by hook category
    # activate/deactivate all forward hooks that have been registered
    hookmngr.activate_all_hooks(category='forward_hook')
    # --- end README
    assert fired() == 2
    # --- README
    hookmngr.deactivate_all_hooks(category='forward_hook')
    # --- end README
    assert fired() == 0


def test_contexts(env, capsys):
    HookManager, model, my_module, other_module = env
    more_modules = []
    hookmngr = HookManager()
    hookmngr.register_forward_hook(my_forward_hook, my_module_name=my_module,
                                   other_module_name=other_module, activate=False)
    # --- README
    with hookmngr.hook_all_context():
        # all hooks active
        ...
    # all hooks inactive
    # --- end README
        assert all(h.active for h in hookmngr.name_to_hookhandle.values())
    assert not any(h.active for h in hookmngr.name_to_hookhandle.values())
    # --- README
    with hookmngr.hook_module_context(my_module, other_module, *more_modules):
        # hooks on my_module, other_module, etc. are active
        ...
    # hooks on my_module, other_module, etc. are inactive
    # --- end README
        run(model)
    assert capsys.readouterr().out.count("Finished") == 2
    run(model)
    assert capsys.readouterr().out == ""


def test_hook_function_and_handle(env):
    HookManager, model, my_module, other_module = env
    hookmngr = HookManager()
    hook_function = hookmngr.register_forward_hook(my_forward_hook, my_module_name=my_module)
    # --- README
    # access the HookHandle obtained from registering hook_function on my_module
    hook_handle = hook_function.module_to_handle[my_module]
    hook_handle.module # = my_module
    hook_handle.hook_fn # = hook_function
    # activate/deactivate hook_function for my_module
    hook_handle.activate()
    hook_handle.deactivate()
    # --- end README
    assert isinstance(hook_function, HookFunction) and isinstance(hook_handle, HookHandle)
    assert hook_handle.module is my_module and hook_handle.hook_fn is hook_function
    assert not hook_handle.active and not my_module._forward_hooks


def test_lookup_tables_and_removal(env):
    HookManager, model, my_module, other_module = env
    hookmngr = HookManager()
    hookmngr.register_forward_hook(my_forward_hook, my_module_name=my_module)
    # --- README
    hookmngr.name_to_module['my_module_name']
    # --- end README
    assert hookmngr.name_to_module['my_module_name'] is my_module
    # --- README
    hookmngr.register_forward_hook(my_forward_hook, hook_fn_name='my_forward_hook')
    # --- end README
    # --- README
    hookmngr.name_to_hookfn['my_forward_hook']
    # --- end README
    assert hookmngr.name_to_hookfn[repr(my_forward_hook)].fn is my_forward_hook
    hookmngr.register_forward_hook(my_forward_hook, hook_fn_name='my_forward_hook', my_module=other_module)
    # --- README
    # access the HookHandle obtained from registering my_forward_hook on my_module
    hookmngr.name_to_hookhandle['my_forward_hook[my_module]']
    # --- end README
    assert hookmngr.name_to_hookhandle['my_forward_hook[my_module]'].module is other_module
    # --- README
    hookmngr.remove_hook_function(my_forward_hook)
    # --- end README
    assert hookmngr.name_to_hookhandle == {} and hookmngr.name_to_hookfn == {}
    assert hookmngr.name_to_module == {} and not my_module._forward_hooks
    hookmngr.register_forward_hook(my_forward_hook, hook_fn_name='my_forward_hook', my_module=my_module)
    hookmngr.register_backward_hook(my_backward_hook, my_module=my_module, other=other_module)
    # --- README
    hookmngr.remove_module_by_name('my_module')
    # --- end README
    assert list(hookmngr.name_to_hookhandle) == [f"{my_backward_hook!r}[other]"]
    hookmngr.register_forward_hook(my_forward_hook, hook_fn_name='my_forward_hook', my_module=my_module)
    # --- README
    hookmngr.remove_hook_by_name('my_forward_hook[my_module]')
    # --- end README
    assert 'my_forward_hook' not in hookmngr.name_to_hookfn and not my_module._forward_hooks
