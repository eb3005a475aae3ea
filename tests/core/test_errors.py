"""The one error hierarchy: every class is a HooklineError and the fitting built-in."""

import pytest

import hookline.storage as storage
import hookline.tracker as tracker
from hookline.storage import errors

BUILTIN = {
    "UnknownNameError": KeyError,
    "DuplicateNameError": ValueError,
    "InvalidArgumentError": ValueError,
    "HookTypeError": TypeError,
    "HookOutputError": ValueError,
    "HookFunctionError": RuntimeError,
    "StorageError": OSError,
    "RunExistsError": FileExistsError,
    "WriterClosedError": ValueError,
    "FormatError": ValueError,
    "RecordIndexError": IndexError,
    "TrackingError": RuntimeError,
    "TrackingUnreachableError": ConnectionError,
    "MissingDependencyError": ImportError,
}


@pytest.mark.parametrize("name, builtin", sorted(BUILTIN.items()))
def test_dual_inheritance(name, builtin):
    cls = getattr(errors, name)
    assert issubclass(cls, errors.HooklineError) and issubclass(cls, builtin)
    assert getattr(storage, name) is cls


def test_every_error_class_is_covered():
    declared = {n for n in errors.__all__ if n != "HooklineError"}
    assert declared == set(BUILTIN)


def test_tracker_reexports_the_same_classes():
    for name in ("HooklineError", "UnknownNameError", "InvalidArgumentError", "HookTypeError"):
        assert getattr(tracker, name) is getattr(errors, name)


def test_unknown_name_error_message_is_not_repr_quoted():
    e = errors.UnknownNameError("no handle 'x[y]'; registered: a[b]")
    assert str(e) == "no handle 'x[y]'; registered: a[b]"
