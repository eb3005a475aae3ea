"""The one hookline error hierarchy.

Every error hookline raises on purpose is a :class:`HooklineError`. Each subclass also inherits
the built-in exception a Python user would expect (``KeyError`` for unknown names, ``ValueError``
for bad values, ``TypeError`` for wrong types, ``OSError`` for storage failures), so existing
``except`` clauses keep working. Messages quote the offending value and say how to fix it.

This module lives in ``hookline.storage`` because storage is the bottom layer (``cli -> tracker
-> storage``); ``hookline.tracker`` re-exports the same classes.
"""

from __future__ import annotations

__all__ = [
    "HooklineError",
    "UnknownNameError",
    "DuplicateNameError",
    "InvalidArgumentError",
    "HookTypeError",
    "HookOutputError",
    "HookFunctionError",
    "RecordIndexError",
    "StorageError",
    "RunExistsError",
    "WriterClosedError",
    "FormatError",
    "TrackingError",
    "TrackingUnreachableError",
    "MissingDependencyError",
]


class HooklineError(Exception):
    """Base class of every error hookline raises on purpose."""


class UnknownNameError(HooklineError, KeyError):
    """A module, hook function, handle, field or run name that is not registered / present."""

    def __str__(self) -> str:
        # KeyError.__str__ repr()s its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


class DuplicateNameError(HooklineError, ValueError):
    """A name that is already taken by a different object (e.g. one name for two modules)."""


class InvalidArgumentError(HooklineError, ValueError):
    """An argument with a valid type but an invalid value (unknown category, negative step...)."""


class HookTypeError(HooklineError, TypeError):
    """An argument of the wrong type (non-callable hook, non-Module target, bad field value)."""


class HookOutputError(HooklineError, ValueError):
    """A hook returned something that cannot replace the module's inputs or outputs."""


class HookFunctionError(HooklineError, RuntimeError):
    """A user hook raised; the message names the hook handle, ``__cause__`` is the original."""


class RecordIndexError(HooklineError, IndexError):
    """A record index outside a field's records."""


class StorageError(HooklineError, OSError):
    """Writing or reading hookline data failed (full disk, I/O error, unreadable file)."""


class RunExistsError(HooklineError, FileExistsError):
    """A new recording was pointed at a directory that already holds a run (pass ``resume=True``
    to continue that run on purpose)."""


class WriterClosedError(HooklineError, ValueError):
    """An operation on a writer or recorder that was already closed."""


class FormatError(HooklineError, ValueError):
    """A file or directory that is not valid hookline data (or of an unsupported version)."""


class TrackingError(HooklineError, RuntimeError):
    """An MLflow request failed (server down, upload error, unknown run)."""


class TrackingUnreachableError(TrackingError, ConnectionError):
    """The MLflow tracking server does not answer (refused, unresolvable, timed out): also an
    ``OSError``/``ConnectionError``. Recorded files stay on disk; ``hookline sync`` uploads them
    later."""


class MissingDependencyError(HooklineError, ImportError):
    """An optional part of hookline was used without the package it needs; the message names the
    extra to install (e.g. ``pip install 'hookline[transformers]'``)."""
