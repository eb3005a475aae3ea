"""Single-op calls: the module classes whose call may skip the identity node, and the checks.

A module whose forward is one autograd op on its input (``nn.Linear`` on a 2-d input, a
convolution with zero padding on a batched input, a layer norm, an out-of-place pointwise
activation: :data:`_SINGLE_OP`) creates one graph node per call, and that node's edge to the input
already carries exactly the call's contribution to the input's gradient. The backward hooks of
such a call read ``grad_in`` off that node instead of an identity node
(:meth:`~hookline.tracker.hooks.backward.BackwardCall.attach_node`), for 8-10% less per call
inside a training step (docs/hooks.md). :func:`single_op_input` decides, per call, whether
nothing can come between the input the pre-hook saw and the op: the class's own ``forward`` and
functional, plain parameters, no autocast or function mode, no global or torch backward hooks.
The dispatcher (``ModuleHooks``) adds what only it can see: no other hook before or after the
manager's, no forward hook function that is not passive.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hookline.tracker.hooks.pytree import Leaves

__all__ = ["single_op_input"]

_Tensor = torch.Tensor
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_is_compiling = torch.compiler.is_compiling
# (conservative where torch lacks it: no single-op calls)
_autocast_on = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)
_function_mode_on = getattr(torch._C, "_is_torch_function_mode_enabled", lambda: True)


def _always(module: nn.Module, x: _Tensor) -> bool:
    return True


def _out_of_place(module: nn.Module, x: _Tensor) -> bool:
    return not module.inplace


def _matrix(module: nn.Module, x: _Tensor) -> bool:
    return x.dim() == 2  # F.linear folds other shapes through views (several nodes)


def _batched_zero_padded(dims: int) -> Any:
    def check(module: nn.Module, x: _Tensor) -> bool:
        # unbatched inputs go through unsqueeze/squeeze, other padding modes through F.pad, and
        # padding="same" pads first when a kernel's reach is even
        # (complex inputs: F.conv* adds up real convolutions)
        return (
            x.dim() == dims + 2 and module.padding_mode == "zeros" and module.padding != "same"
            and not x.is_complex()
        )

    return check


# Module classes whose forward is one autograd op on their single input, under a condition on
# the module and input, and the names of that op's graph node (each checked by tests against
# the identity node). Exact classes only: a subclass may override forward.
_SINGLE_OP: dict[type, tuple[Any, tuple[str, ...]]] = {
    nn.Linear: (_matrix, ("AddmmBackward0", "MmBackward0")),
    nn.Conv1d: (_batched_zero_padded(1), ("ConvolutionBackward0",)),
    nn.Conv2d: (_batched_zero_padded(2), ("ConvolutionBackward0",)),
    nn.Conv3d: (_batched_zero_padded(3), ("ConvolutionBackward0",)),
    nn.LayerNorm: (_always, ("NativeLayerNormBackward0",)),
    nn.GELU: (_always, ("GeluBackward0",)),
    nn.Tanh: (_always, ("TanhBackward0",)),
    nn.Sigmoid: (_always, ("SigmoidBackward0",)),
    nn.ReLU: (_out_of_place, ("ReluBackward0",)),
    nn.SiLU: (_out_of_place, ("SiluBackward0",)),
    nn.LeakyReLU: (_out_of_place, ("LeakyReluBackward0",)),
}
_CLASS_FORWARD = {cls: cls.forward for cls in _SINGLE_OP}
_F = nn.functional
_C_nn = torch._C._nn
# What each class's forward looks up at call time (module attributes, down to the builtin): a
# patched one (a "quick GELU") can make other nodes around the same input.
_FUNCTIONS = {
    cls: tuple((owner, name, getattr(owner, name)) for owner, name in entries)
    for cls, entries in (
        (nn.Linear, ((_F, "linear"),)),
        (nn.Conv1d, ((_F, "conv1d"), (nn.Conv1d, "_conv_forward"))),
        (nn.Conv2d, ((_F, "conv2d"), (nn.Conv2d, "_conv_forward"))),
        (nn.Conv3d, ((_F, "conv3d"), (nn.Conv3d, "_conv_forward"))),
        (nn.LayerNorm, ((_F, "layer_norm"), (torch, "layer_norm"))),
        (nn.GELU, ((_F, "gelu"),)),
        (nn.Tanh, ((torch, "tanh"),)),
        (nn.Sigmoid, ((torch, "sigmoid"),)),
        (nn.ReLU, ((_F, "relu"), (torch, "relu"))),
        (nn.SiLU, ((_F, "silu"), (_C_nn, "silu"))),
        (nn.LeakyReLU, ((_F, "leaky_relu"), (_C_nn, "leaky_relu"))),
    )
}
_Parameter = nn.Parameter
_module_globals = nn.modules.module
_global_hooks = _module_globals._global_forward_hooks
_global_backward_hooks = _module_globals._global_backward_hooks
_global_backward_pre_hooks = _module_globals._global_backward_pre_hooks


def single_op_input(module: nn.Module, inputs: Leaves) -> tuple[_Tensor, tuple[str, ...]] | None:
    """The input of a call whose gradient can be read off the call's one op node, and the names
    that node may have; None when the call must take the identity node.

    The manager's pre-hook asks only when it is the module's last forward pre-hook, its forward
    hook the module's only one, and all its forward hook functions passive (no other hook can
    change the input or the output, or compute with the input).
    """
    rule = _SINGLE_OP.get(type(module))
    if rule is None or len(inputs) != 1:
        return None
    x = inputs[0]
    if (
        type(x) is not _Tensor
        or x.grad_fn is None  # leaves: their edge is the grad accumulator (kept simple)
        or x.layout is not torch.strided
        or x.is_nested
        or _unwrap_if_dead(x) is not x  # escaped a torch.func transform: the op unwraps it
        or _autocast_on()  # inserts a cast node before the op
        or _function_mode_on()  # a TorchFunctionMode may run anything in place of the op
        or _is_compiling()
        or _global_hooks  # could replace the output before the manager's forward hook sees it
        # torch's full backward hooks wrap the inputs after every pre-hook
        or module._backward_hooks
        or module._backward_pre_hooks
        or _global_backward_hooks
        or _global_backward_pre_hooks
        or type(module).forward is not _CLASS_FORWARD[type(module)]
        or "forward" in module.__dict__
        or not rule[0](module, x)
    ):
        return None
    for owner, name, function in _FUNCTIONS[type(module)]:
        if getattr(owner, name) is not function:
            return None
    # A tensor-subclass weight (weight-only quantisation), as a parameter, a buffer or a plain
    # attribute, turns the op into several.
    for tensors in (module._parameters.values(), module._buffers.values()):
        for p in tensors:
            if p is not None and type(p) is not _Parameter and type(p) is not _Tensor:
                return None
    attrs = module.__dict__
    for name in ("weight", "bias"):
        p = attrs.get(name)
        if p is not None and type(p) is not _Parameter and type(p) is not _Tensor:
            return None
    return x, rule[1]
