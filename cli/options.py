"""Shared option bundles, run resolution, consoles and progress bars for the ``hookline`` CLI."""

from __future__ import annotations

import json
import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import click

# (the one size format: binary units named as such, shared with the Recorder's summary)
from hookline.storage.words import human_bytes

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


# --------------------------------------------------------------------------------------------
# option bundles
# --------------------------------------------------------------------------------------------
def json_option(fn: Callable) -> Callable:
    return click.option(
        "--json", "as_json", is_flag=True, help="Print machine-readable JSON (schema: docs/cli.md)."
    )(fn)


def quiet_option(fn: Callable) -> Callable:
    return click.option("-q", "--quiet", is_flag=True, help="No progress bars.")(fn)


def tracking_uri_option(fn: Callable) -> Callable:
    return click.option(
        "--tracking-uri",
        metavar="URI",
        default=None,
        help="MLflow tracking URI (default: MLflow's own resolution: $MLFLOW_TRACKING_URI, "
        "else sqlite mlflow.db in the working directory).",
    )(fn)


# --------------------------------------------------------------------------------------------
# runs
# --------------------------------------------------------------------------------------------
def quiet_mlflow_logs() -> None:
    """MLflow announces creating its sqlite tables at INFO level on first use; not news to a
    CLI user (warnings and errors still show)."""
    import logging

    for name in ("mlflow.store.db.utils", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)


def run_source(run: str) -> str:
    """Normalise a RUN argument: a directory, ``runs:/ID``/``mlflow-artifacts:`` URI, or a bare
    MLflow run id (turned into ``runs:/ID``)."""
    from hookline.storage.keys import is_mlflow_run_id
    from hookline.storage.mlflow.uri import URI_PREFIXES

    if os.path.exists(run):
        return run
    if run.startswith(URI_PREFIXES):
        return run
    if is_mlflow_run_id(run):
        return f"runs:/{run}"
    raise click.ClickException(
        f"run {run!r} not found: not a run directory, a runs:/<id> URI or an MLflow run id"
    )


def open_run_arg(run: str, tracking_uri: str | None = None) -> Any:
    """Open a RUN argument with the storage reader."""
    from hookline.storage import open_run

    src = run_source(run)
    kwargs: dict[str, Any] = {}
    if tracking_uri is not None:
        kwargs["tracking_uri"] = tracking_uri
    return open_run(src, **kwargs)


# --------------------------------------------------------------------------------------------
# paths hookline writes
# --------------------------------------------------------------------------------------------
def output_path(path: str | os.PathLike, option: str) -> Path:
    """Check a path a command is asked to write (``export --out``, ``compare --plot``, ``demo
    --out``): the one rule is that its folder must exist and be writable; hookline never creates
    missing folders on its own (a typo would scatter files).

    Args:
        path: the path as given.
        option: the option that named it, for the message (e.g. ``"--out"``).

    Returns:
        ``Path(path)``.

    Raises:
        click.UsageError: the folder is missing, not a folder, or not writable; the message quotes
            the path and says how to fix it (``mkdir -p ...``).
    """
    import shlex

    p = Path(path)
    folder = p.parent if str(p.parent) else Path(".")
    ctx = click.get_current_context(silent=True)
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        fix = "choose another path" if folder.exists() else f"create it first (mkdir -p {shlex.quote(str(folder))})"
        raise click.UsageError(f"{option} {str(path)!r}: folder {str(folder)!r} {what}; {fix}", ctx=ctx)
    if not os.access(folder, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise click.UsageError(f"{option} {str(path)!r}: {str(p)!r} cannot be written (permission denied); "
                               "choose a folder you can write to", ctx=ctx)
    return p


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------
def interactive() -> bool:
    try:
        return sys.stdout.isatty() and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def console(stderr: bool = False):
    """A rich console on stdout (tables) or stderr (progress, notes)."""
    from rich.console import Console

    width = None
    if not interactive():
        # Not a terminal: honour $COLUMNS, else a generous width so nothing is cut in logs.
        width = int(os.environ.get("COLUMNS", 0) or 0) or 120
    return Console(stderr=stderr, width=width, highlight=False, soft_wrap=False)


def print_table(table: Any) -> None:
    """Print a rich table without cutting cells: rich cuts no-wrap columns (numbers, statuses)
    at the console's edge when they do not fit next to the folding columns' minimum widths. The
    table is then laid out at the width they need (the terminal wraps the lines instead; folding
    columns such as handle ids still fold)."""
    from rich.console import Console
    from rich.measure import Measurement

    c = console()
    opts = c.options.update_width(10_000)
    pad = getattr(table, "_get_padding_width", lambda i: 2)  # rich's own layout (private API)
    need = getattr(table, "_extra_width", 0)
    for i, col in enumerate(table.columns):
        if col.no_wrap:
            need += max(Measurement.get(c, opts, cell).maximum for cell in (col.header, *col.cells))
        else:
            need += max(col.min_width or 1, max(len(line) for line in str(col.header).splitlines() or [""]))
        need += pad(i) + 1  # (+1: rich rounds column shares down)
    if need > c.width:
        c = Console(width=need, highlight=False, soft_wrap=False)
    c.print(table)


#: Characters :func:`safe_text` escapes: Unicode categories Cc (C0 and C1 controls, DEL), Cf
#: (invisible format characters: bidi overrides, zero-width characters), Cs (lone surrogates), Zl
#: and Zp (line and paragraph separators).
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_SHORT_ESCAPES = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def safe_text(value: Any, keep: str = "") -> str:
    """``str(value)`` fit for a terminal: every text the CLI prints that comes from a run (handle
    ids, module names and types, field names, meta values, file names, run names, MLflow tags)
    and every error message goes through here.

    Control characters (C0, DEL, C1), invisible format characters (bidi overrides, zero-width
    characters), line/paragraph separators and lone surrogates are written as visible Python
    escapes (``"\\x1b"``, ``"\\u202e"``), so a name cannot move the cursor, recolour or clear the
    terminal, or hide text; printable unicode is unchanged. Backslashes are not escaped.

    Args:
        value: anything; ``str(value)`` is escaped.
        keep: characters left as they are (e.g. ``"\\n"`` for a multi-line report).
    """
    import unicodedata

    text = str(value)
    if text.isprintable() and text.isascii():  # the common case: nothing to look at
        return text
    out = []
    for ch in text:
        if ch not in keep and unicodedata.category(ch) in _UNSAFE_CATEGORIES:
            out.append(_escape(ch))
        else:
            out.append(ch)
    return "".join(out)


def _escape(ch: str) -> str:
    """One character as its Python escape (``\\n``, ``\\x1b``, ``\\u202e``, ``\\U000e0001``)."""
    code = ord(ch)
    if ch in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[ch]
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def plain(value: Any):
    """A table cell / print argument shown verbatim (no rich markup: handle ids contain [...]),
    with control characters escaped (:func:`safe_text`)."""
    from rich.text import Text

    return Text("-" if value is None else safe_text(value))


def esc(value: Any) -> str:
    """A value embedded in a markup string: control characters escaped (:func:`safe_text`), rich
    markup escaped."""
    from rich.markup import escape

    return escape(safe_text(value))


def echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=_json_default, allow_nan=False))


def _json_default(o: Any) -> Any:
    import numpy as np

    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        f = float(o)
        return f if math.isfinite(f) else None
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    return str(o)


def clean_json(obj: Any) -> Any:
    """Replace NaN/inf floats by None recursively (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: clean_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_json(v) for v in obj]
    return obj


def fmt_num(x: Any, digits: int = 4) -> str:
    if x is None:
        return "-"
    try:
        f = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(f):
        return "nan"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    return f"{f:.{digits}g}"


@contextmanager
def progress_bar(description: str, total: int | None, *, quiet: bool = False) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr, shown only on a terminal and without ``--quiet``.

    Yields ``advance(n)``.
    """
    if quiet or not interactive():
        yield lambda n=1: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console(stderr=True),
        transient=True,
    ) as p:
        task = p.add_task(esc(description), total=total)  # (descriptions name handles: [...])
        yield lambda n=1: p.advance(task, n)


# --------------------------------------------------------------------------------------------
# --steps
# --------------------------------------------------------------------------------------------
def parse_steps(spec: str | None) -> Callable[[Any], Any] | None:
    """Parse ``--steps``: comma-separated steps and ``start:stop[:stride]`` ranges (stop
    exclusive, start/stop optional), e.g. ``0,10,20``, ``0:100``, ``:50``, ``100:``, ``0:100:10``.

    Returns a function mapping a step array to a boolean mask, or ``None`` for "all steps".
    """
    if spec is None:
        return None
    items = [p.strip() for p in spec.split(",")]
    if not spec.strip() or any(not p for p in items):
        raise click.BadParameter(f"{spec!r}: give steps like 0,10,20 or a range like 0:100", param_hint="'--steps'")
    singles: list[int] = []
    ranges: list[tuple[int | None, int | None, int]] = []
    for p in items:
        try:
            if ":" in p:
                parts = p.split(":")
                if len(parts) > 3:
                    raise ValueError
                start = int(parts[0]) if parts[0] else None
                stop = int(parts[1]) if parts[1] else None
                stride = int(parts[2]) if len(parts) == 3 and parts[2] else 1
                if stride < 1 or (start is not None and start < 0) or (stop is not None and stop < 0):
                    raise ValueError
                ranges.append((start, stop, stride))
            else:
                v = int(p)
                if v < 0:
                    raise ValueError
                singles.append(v)
        except ValueError:
            raise click.BadParameter(
                f"{p!r} in {spec!r} is not a step or a start:stop[:stride] range of non-negative ints",
                param_hint="'--steps'",
            ) from None

    def mask(steps: Any) -> Any:
        import numpy as np

        s = np.asarray(steps, np.int64)
        m = np.isin(s, singles)
        for start, stop, stride in ranges:
            lo = 0 if start is None else start
            r = s >= lo
            if stop is not None:
                r &= s < stop
            if stride != 1:
                r &= (s - lo) % stride == 0
            m |= r
        return m

    return mask
