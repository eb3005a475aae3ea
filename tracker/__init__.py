"""hookline.tracker: managed module hooks and the Recorder that captures through them."""

from __future__ import annotations

from hookline.storage.errors import (
    DuplicateNameError,
    HookFunctionError,
    HookOutputError,
    HooklineError,
    HookTypeError,
    InvalidArgumentError,
    RunExistsError,
    UnknownNameError,
)
from hookline.tracker.capture.recompute import is_recomputing
from hookline.tracker.capture.recorder import Recorder
from hookline.tracker.capture.stats import StatsSpec
from hookline.tracker.capture.summary import RecorderSummary
from hookline.tracker.hooks.handles import HookFunction, HookHandle, passive
from hookline.tracker.hooks.manager import HookManager
from hookline.tracker.hooks.pytree import Leaves
from hookline.tracker.hooks.select import select

__all__ = [
    "DuplicateNameError",
    "HookFunction",
    "HookFunctionError",
    "HookHandle",
    "HookManager",
    "HookOutputError",
    "HooklineError",
    "HookTypeError",
    "InvalidArgumentError",
    "Leaves",
    "Recorder",
    "RecorderSummary",
    "RunExistsError",
    "StatsSpec",
    "UnknownNameError",
    "is_recomputing",
    "passive",
    "select",
]
