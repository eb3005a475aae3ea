"""``hookline export RUN --format arrow``: aligned fields as a Hugging Face ``datasets``
directory (``datasets.load_from_disk``); the work is
:func:`hookline.storage.analysis.dataset_arrow.export_arrow`."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Sequence

import click
import numpy as np

from .options import open_run_arg, output_path, parse_steps, progress_bar, safe_text

__all__ = ["export_arrow_command"]


def _refs(r: Any, handle: str | None, field: str | None, refs: Sequence[str]) -> list[str]:
    """The field references to export: ``--field`` ones, HANDLE's fields (or HANDLE/FIELD), or
    every field of every handle."""
    out = list(refs)
    if handle is not None:
        out += [f"{handle}/{field}"] if field is not None else [f"{handle}/{f}" for f in r[handle].fields]
    if not out:
        out = [f"{h}/{f}" for h in r.handles for f in r[h].fields]
    return out


def _clear(dest: Path, force: bool) -> None:
    """Refuse an existing output; with ``--force`` remove it if it is a ``datasets`` directory."""
    if not dest.exists():
        return
    if not force:
        raise click.ClickException(f"output {str(dest)!r} exists; pass --force to overwrite it")
    if not (dest.is_dir() and (dest / "state.json").is_file() and (dest / "dataset_info.json").is_file()):
        raise click.ClickException(f"output {str(dest)!r} exists and is not a datasets directory; --force "
                                   f"replaces only those: choose another path")
    shutil.rmtree(dest)


def export_arrow_command(run: str, handle: str | None, field: str | None, refs: Sequence[str], rows: str,
                         out: str, steps_spec: str | None, force: bool, quiet: bool,
                         tracking_uri: str | None) -> None:
    """Export aligned rows of fields of RUN to the ``datasets`` directory ``out``."""
    from hookline.storage.analysis.dataset_arrow import export_arrow, require_datasets
    from hookline.storage.analysis.dataset_plan import make_plan, parse_refs
    from hookline.storage.reader import LocalSource

    if field is not None and handle is None:
        raise click.UsageError("FIELD needs HANDLE; or name fields with --field 'HANDLE/FIELD'")
    require_datasets()  # (before any work)
    mask_fn = parse_steps(steps_spec)
    dest = output_path(out, "--out")
    r = open_run_arg(run, tracking_uri)
    if isinstance(r.source, LocalSource) and dest.resolve().is_relative_to(Path(r.source.root).resolve()):
        raise click.ClickException(f"output {out!r} is inside the run directory {str(r.source.root)!r}; "
                                   f"export to a path outside it")
    wanted = _refs(r, handle, field, refs)
    steps = None
    if mask_fn is not None:  # (the steps of the first field that --steps keeps)
        have = np.unique(r[wanted[0].rpartition("/")[0]].steps)
        steps = [int(s) for s in have[mask_fn(have)]]
        if not steps:
            span = f"{have.min()}..{have.max()}" if have.size else "none"
            raise click.ClickException(f"--steps {steps_spec!r} selects no record (the steps: {span})")
    total = make_plan(r, parse_refs(wanted, r), rows=rows, steps=steps).num_rows  # (checks before writing)
    _clear(dest, force)
    with progress_bar("exporting rows", total, quiet=quiet) as advance:
        n = export_arrow(r, wanted, dest, rows=rows, steps=steps, advance=advance)
    click.echo(safe_text(f"exported {n} rows of {len(wanted)} field{'s' if len(wanted) > 1 else ''} "
                         f"({', '.join(wanted)}) to {out}"))
