"""hookline.tracker: managed module hooks and the Recorder that captures through them."""

from __future__ import annotations

from hookline.storage.errors import (
    DuplicateNameError,
    HookFunctionError,
    HookOutputError,
    HooklineError,
    HookTypeError,
    InvalidArgumentError,
    UnknownNameError,
)

__all__ = [
    "DuplicateNameError",
    "HookFunctionError",
    "HookOutputError",
    "HooklineError",
    "HookTypeError",
    "InvalidArgumentError",
    "UnknownNameError",
]
