"""Turning library errors into one-line CLI errors.

Every :class:`~hookline.storage.HooklineError` (and the ``OSError`` family that h5py and the file
system raise) becomes a :class:`click.ClickException`: click prints ``Error: <message>`` on stderr
and exits with code 1 — no traceback. Any other exception (a bug, or a dependency's error) also
becomes one line, ``Error: unexpected <Type>: <message> (...)``. Set ``HOOKLINE_DEBUG=1`` to get
the traceback instead.

Every message printed here (library errors, click's own, warnings) passes
:func:`~hookline.cli.options.safe_text`: a message that quotes a run's names cannot send control
characters to the terminal.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Callable, TypeVar

import click

from hookline.storage.errors import HooklineError

from .options import safe_text

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["HooklineGroup", "OneLineUsageError", "one_line", "translate", "translate_errors"]


def one_line(text: str) -> str:
    """Collapse a (possibly multi-line) message into one line, control characters escaped."""
    return safe_text(" ".join(str(text).split()))


def translate(exc: BaseException) -> click.ClickException | None:
    """The ClickException for a library error, or ``None`` when ``exc`` is not one."""
    if isinstance(exc, (click.ClickException, click.exceptions.Exit, click.exceptions.Abort)):
        return None
    if isinstance(exc, HooklineError):
        return click.ClickException(one_line(str(exc)) or type(exc).__name__)
    if isinstance(exc, OSError):
        # FileNotFoundError etc. from the file system, h5py's "Unable to open file ..." errors.
        parts = [exc.strerror or "", repr(exc.filename) if exc.filename else ""]
        msg = ": ".join(p for p in parts if p) if exc.strerror else str(exc)
        return click.ClickException(one_line(msg) or type(exc).__name__)
    if isinstance(exc, Exception):
        # Not raised on purpose (a bug, or an error from a dependency): still one line, with the
        # way to get the traceback for a bug report.
        return click.ClickException(
            f"unexpected {type(exc).__name__}: {one_line(str(exc))[:500]} "
            f"(set HOOKLINE_DEBUG=1 for the traceback and please report it)"
        )
    return None


def _debug() -> bool:
    return os.environ.get("HOOKLINE_DEBUG", "") not in ("", "0")


def translate_errors(fn: F) -> F:
    """Decorator: run ``fn`` and turn library errors into one-line click errors."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            ce = None if _debug() else translate(e)
            if ce is None:
                raise
            raise ce from e

    return wrapper  # type: ignore[return-value]


def _show_warning(message: Any, category: type, filename: str, lineno: int, file: Any = None,
                  line: str | None = None) -> None:
    """Python warnings as one ``warning: ...`` line on stderr (no source line, no path)."""
    click.echo(f"warning: {one_line(str(message)).removeprefix('hookline: ')}", err=True)


class OneLineUsageError(click.ClickException):
    """A usage error (bad option value, missing argument, unknown command) as one line on stderr,
    ``Error: <click's message> (see 'hookline <command> --help')``, exit code 2."""

    exit_code = 2

    @classmethod
    def of(cls, e: click.UsageError, group_ctx: click.Context | None = None) -> OneLineUsageError:
        """The one-line error for ``e``; ``group_ctx`` (the group's context) names the command
        when click raised ``e`` without one (e.g. ``Option '--plot' requires an argument``)."""
        if e.ctx is not None:
            path = e.ctx.command_path
        elif group_ctx is not None and group_ctx.invoked_subcommand:
            path = f"{group_ctx.command_path} {group_ctx.invoked_subcommand}"
        else:
            path = group_ctx.command_path if group_ctx is not None else "hookline"
        return cls(f"{one_line(e.format_message())} (see '{path} --help')")


# click >= 8.2 raises this UsageError subclass for a bare ``hookline`` (``no_args_is_help``); its
# message is the whole formatted help, which must reach the user as-is, not collapsed.
_HELP_ERRORS: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(click.exceptions, "NoArgsIsHelpError", None),) if t is not None
)


def _usage(e: click.UsageError, group_ctx: click.Context | None = None) -> click.ClickException:
    """The exception to raise for click's usage error ``e``."""
    return e if isinstance(e, _HELP_ERRORS) else OneLineUsageError.of(e, group_ctx)


class HooklineGroup(click.Group):
    """The ``hookline`` group: library errors and usage errors in any subcommand become
    one-line messages, and Python warnings one-line ``warning:`` messages."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as e:  # the group's own options
            u = _usage(e)
            if u is e:
                raise
            raise u from e

    def invoke(self, ctx: click.Context) -> Any:
        saved = warnings.showwarning
        if not _debug():
            warnings.showwarning = _show_warning
        try:
            return super().invoke(ctx)
        except click.UsageError as e:  # a subcommand's arguments, or an unknown command
            u = _usage(e, ctx)
            if u is e:
                raise
            raise u from e
        except click.ClickException as e:  # a command's own message, which may quote a run
            e.message = safe_text(e.message)
            raise
        except Exception as e:
            ce = None if _debug() else translate(e)
            if ce is None:
                raise
            raise ce from e
        finally:
            warnings.showwarning = saved
