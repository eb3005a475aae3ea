"""Detect torch module hooks left behind (used by the autouse fixture in conftest.py)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.nn.modules import module as torch_module

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def leftover_hooks(modules: Iterable[nn.Module]) -> list[str]:
    """Describe every torch module hook left on ``modules`` or registered globally."""
    found = [f"{type(m).__name__}.{d}: {dict(getattr(m, d))}" for m in modules for d in _HOOK_DICTS
             if getattr(m, d, None)]
    found += [f"torch.nn.modules.module.{d}" for d in _GLOBAL_DICTS if getattr(torch_module, d)]
    return found
