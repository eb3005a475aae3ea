"""Collision-free mapping from hook handle ids to file names and MLflow keys; the rules for names and MLflow run ids.

A handle id reads ``"<hook_fn_name>[<module_name>]"`` (e.g. ``outputs[blocks.0.mlp]``). Its
*key* is used as the file name inside a run directory (``<key>.h5``), as the MLflow artifact
path (``hookline/<key>.h5``) and inside MLflow tag and metric keys. MLflow keys allow only
``[A-Za-z0-9_./\\- :]`` and at most 250 characters, so the key is an escaped form of the id:

* An id of the form ``fn[module]`` becomes ``esc(fn) + "/" + esc(module)`` so that each hook
  function gets its own folder (``outputs/blocks.0.mlp``). Any other id becomes ``esc(id)``.
  Only the structured form contains ``/``, so the two forms never collide.
* ``esc`` keeps ``A-Z a-z 0-9 _ .`` and writes every other character as ``-xx`` per UTF-8
  byte (lower-case hex), e.g. ``-`` -> ``-2d``, ``<`` -> ``-3c``. Because ``-`` always starts an
  escape, ``esc`` is injective. An empty part is written ``-e`` and a part that is all dots
  (``.``/``..``, which are not usable as path components) gets a leading ``-d``; neither can be
  produced by escaping, since ``e`` and ``d.`` are not two hex digits.
* A key longer than :data:`MAX_KEY_LEN` is cut to ``MAX_KEY_LEN - 18`` characters (never inside
  an escape) followed by ``-h`` and the first 16 hex digits of the SHA-1 of the id. ``h`` is not a
  hex digit, so hashed keys cannot collide with unhashed ones.

The original id is always stored in the file attributes, the manifest and the MLflow tag values.

:func:`is_mlflow_run_id` is the one rule for telling a bare MLflow run id from a path or a name
(the reader, the CLI and MLflow URI parsing all use it).

:func:`check_name` is the one rule for names that enter a run (handle ids, module names and
types, hook function names, categories, field names): the writer checks them at
``add_handle()``/``write()`` and the tracker when a recording hook is registered. A name is a
``str`` of at most :data:`MAX_NAME_LEN` characters without control characters (C0
``U+0000..U+001F``, DEL ``U+007F``, C1 ``U+0080..U+009F``) and without lone surrogates (which
UTF-8, and so HDF5 and JSON files, cannot hold). Such names are stored as HDF5 attributes, JSON and
MLflow tag values, and printed by the CLI: a NUL cannot be stored in an HDF5 string, and an
escape sequence would reach the terminal of whoever reads the run. Any other character,
printable unicode included, is allowed.
"""

from __future__ import annotations

import hashlib
import re

from .errors import HookTypeError, InvalidArgumentError

__all__ = ["handle_key", "escape_part", "is_mlflow_run_id", "check_name", "MAX_KEY_LEN", "MAX_NAME_LEN",
           "MLFLOW_RUN_ID_PATTERN"]

#: Longest key; leaves room for prefixes such as ``hookline.`` and ``.grad_out.0.norm_max``
#: inside MLflow's 250-character key limit.
MAX_KEY_LEN = 160

#: Longest name :func:`check_name` accepts (handle ids included). Keys are hashed down to
#: :data:`MAX_KEY_LEN`, and MLflow tag values hold 8000 characters, so this bound is about
#: readable tables and messages, not a storage limit.
MAX_NAME_LEN = 1000

#: What :func:`check_name` refuses: C0 controls, DEL, C1 controls, lone surrogates.
_BAD_CHAR = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_SAFE = re.compile(r"[A-Za-z0-9_.]")
_STRUCTURED = re.compile(r"^(?P<fn>.+)\[(?P<mod>.*)\]$", re.DOTALL)

#: A run id as MLflow generates it (``uuid.uuid4().hex``): 32 lower-case hex digits. A regular
#: expression source, for patterns that embed a run id (``mlflow-artifacts:`` URIs).
MLFLOW_RUN_ID_PATTERN = "[0-9a-f]{32}"
_MLFLOW_RUN_ID = re.compile(MLFLOW_RUN_ID_PATTERN)


def is_mlflow_run_id(text: str) -> bool:
    """Whether ``text`` is shaped like a run id that MLflow generates (32 lower-case hex digits).

    This decides when a bare argument means an MLflow run rather than a path (``open_run``,
    ``hookline show ID``, ``parse_run_uri``). MLflow itself checks ids on first request.

    Example:
        >>> is_mlflow_run_id("0a1b2c3d4e5f60718293a4b5c6d7e8f9")
        True
        >>> is_mlflow_run_id("runs/baseline")
        False
    """
    return isinstance(text, str) and _MLFLOW_RUN_ID.fullmatch(text) is not None


def _quoted(value: str) -> str:
    """``repr(value)``, shortened in the middle when long (messages stay one readable line)."""
    if len(value) <= 120:
        return repr(value)
    return f"{value[:60]!r}...{value[-40:]!r} ({len(value)} characters)"


def check_name(value: object, what: str, *, fix: str | None = None) -> str:
    """Check a name that enters a run (see the module docstring for the rule).

    Args:
        value: the name.
        what: what it is, for the message (e.g. ``"handle id"``, ``"module name"``).
        fix: how to fix it, for the message (default: remove the character / use a shorter name).

    Returns:
        ``value``, unchanged.

    Raises:
        HookTypeError: ``value`` is not a str.
        InvalidArgumentError: it contains a control character or a lone surrogate, or is longer
            than :data:`MAX_NAME_LEN`; the message quotes it with ``repr`` and names the
            character and its position.

    Example:
        >>> check_name("outputs[blocks.0]", "handle id")
        'outputs[blocks.0]'
        >>> check_name("outputs[a\\x1b[31m]", "handle id")
        Traceback (most recent call last):
        hookline.storage.errors.InvalidArgumentError: handle id 'outputs[a\\x1b[31m]' contains ...
    """
    if not isinstance(value, str):
        raise HookTypeError(f"{what} must be a str, got {type(value).__name__} {value!r:.80}")
    bad = _BAD_CHAR.search(value)
    if bad is not None:
        ch = bad.group()
        kind = "a lone surrogate" if "\ud800" <= ch <= "\udfff" else "the control character"
        raise InvalidArgumentError(
            f"{what} {_quoted(value)} contains {kind} {ch!r} (U+{ord(ch):04X}) at position {bad.start()}; "
            f"names are stored in HDF5 files, manifests and MLflow tags and printed by the CLI, so they may "
            f"not contain NUL, other control characters (U+0000-U+001F, U+007F-U+009F) or lone surrogates: "
            f"{fix or 'remove the character from the name'}")
    if len(value) > MAX_NAME_LEN:
        raise InvalidArgumentError(
            f"{what} {value[:60]!r}... is {len(value)} characters long; at most {MAX_NAME_LEN} are allowed: "
            f"{fix or 'use a shorter name'}")
    return value


def escape_part(part: str) -> str:
    """One part of a handle id (or a field or tag name) escaped to ``[A-Za-z0-9_.-]``, injectively.

    Args:
        part: any string.

    Returns:
        ``part`` with every character outside ``[A-Za-z0-9_.]`` written as ``-xx`` per UTF-8
        byte; ``""`` becomes ``-e`` and an all-dots part gets a leading ``-d`` (see the module
        docstring).
    """
    if part == "":
        return "-e"
    out = []
    for ch in part:
        if _SAFE.fullmatch(ch):
            out.append(ch)
        else:
            out.extend(f"-{b:02x}" for b in ch.encode("utf-8"))
    text = "".join(out)
    if set(text) == {"."}:
        text = "-d" + text
    return text


def handle_key(handle_id: str) -> str:
    """Return the file/MLflow key for a handle id.

    Args:
        handle_id: the hook handle id, usually ``"<hook_fn_name>[<module_name>]"``.

    Returns:
        A string of ``[A-Za-z0-9_./-]`` characters, at most :data:`MAX_KEY_LEN` long, distinct
        for distinct ids.

    Example:
        >>> handle_key("outputs[blocks.0.mlp]")
        'outputs/blocks.0.mlp'
        >>> handle_key("my-hook[]")
        'my-2dhook/-e'
    """
    if not isinstance(handle_id, str):
        raise HookTypeError(f"handle id must be a str, got {handle_id!r} ({type(handle_id).__name__})")
    m = _STRUCTURED.match(handle_id)
    key = escape_part(m["fn"]) + "/" + escape_part(m["mod"]) if m else escape_part(handle_id)
    if len(key) <= MAX_KEY_LEN:
        return key
    cut = MAX_KEY_LEN - 18
    head = key[:cut]
    # Never cut inside an escape: drop a trailing partial "-x" / "-".
    tail = head[-2:]
    if tail.startswith("-"):
        head = head[:-2]
    elif tail.endswith("-"):
        head = head[:-1]
    digest = hashlib.sha1(handle_id.encode("utf-8")).hexdigest()[:16]
    return f"{head}-h{digest}"
