"""Fixtures for the HookManager tests.

Autouse ``no_leftover_hooks``: records every ``nn.Module`` constructed during a test (by wrapping
``nn.Module.__init__``) and fails the test if any of them still carries a torch hook at the end,
or if a global module hook was left behind. Use the ``mgr`` fixture (removes all its hooks at
teardown, before the check) or remove hooks yourself.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import pytest
import torch
from _hook_checks import leftover_hooks
from torch import nn

from hookline.tracker import HookManager


@pytest.fixture(autouse=True)
def no_leftover_hooks(monkeypatch: pytest.MonkeyPatch) -> Iterator[weakref.WeakSet]:
    created: weakref.WeakSet = weakref.WeakSet()
    original_init = nn.Module.__init__

    def init(self: nn.Module, *args: object, **kwargs: object) -> None:
        original_init(self, *args, **kwargs)
        created.add(self)

    monkeypatch.setattr(nn.Module, "__init__", init)
    yield created
    left = leftover_hooks(list(created))
    if left:
        pytest.fail("test left torch hooks behind:\n  " + "\n  ".join(left))


@pytest.fixture
def mgr() -> Iterator[HookManager]:
    """A HookManager whose hooks are all removed at teardown."""
    manager = HookManager()
    yield manager
    manager.remove_all_hooks()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
