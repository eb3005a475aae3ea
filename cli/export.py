"""``hookline export RUN HANDLE [FIELD]``: one field's records to .npy, .csv or .h5; aligned fields
as a Hugging Face ``datasets`` directory with ``--format arrow`` (:mod:`.export_arrow`)."""

from __future__ import annotations

import csv
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import click
import numpy as np

from .options import (
    CONTEXT_SETTINGS,
    open_run_arg,
    output_path,
    parse_steps,
    progress_bar,
    quiet_option,
    safe_text,
    tracking_uri_option,
)

if TYPE_CHECKING:  # (storage is imported when a command runs: `hookline --help` stays fast)
    from hookline.storage.reader import Field


@click.command(context_settings=CONTEXT_SETTINGS, short_help='Export a field to .npy, .csv or .h5, or aligned fields to Arrow.')
@click.argument("run", metavar="RUN")
@click.argument("handle", metavar="HANDLE", required=False)
@click.argument("field", metavar="[FIELD]", required=False)
@click.option("--format", "fmt", type=click.Choice(["npy", "csv", "h5", "arrow"]), required=True,
              help="npy: one array (records, *shape); csv: one row per record (step, call, "
                   "flattened values); h5: datasets step, call, data (ragged: one dataset per record); "
                   "arrow: a datasets.load_from_disk directory, one column per field, aligned rows.")
@click.option("--out", "out", type=click.Path(), required=True, metavar="PATH",
              help="Output file (a directory for --format arrow).")
@click.option("--field", "refs", multiple=True, metavar="HANDLE/FIELD",
              help="--format arrow: a field to export (repeatable; default: HANDLE's fields, or every field).")
@click.option("--rows", type=click.Choice(["sample", "record"]), default="sample", show_default=True,
              help="--format arrow: one row per sample (a (..., d) record gives rows of (d,)) or per record.")
@click.option("--steps", "steps_spec", metavar="SPEC", default=None,
              help="Only these steps: '0,10,20', ranges 'start:stop[:stride]' (stop exclusive, "
                   "e.g. '0:100', ':50', '100:'), or a mix. Default: all records.")
@click.option("--force", is_flag=True, help="Overwrite PATH if it exists.")
@quiet_option
@tracking_uri_option
def export(run: str, handle: str | None, field: str | None, fmt: str, out: str, refs: tuple[str, ...], rows: str,
           steps_spec: str | None, force: bool, quiet: bool, tracking_uri: str | None) -> None:
    """Export one field of one handle to a .npy, .csv or .h5 file, record by record.

    FIELD may be left out when the handle has one field. Records are written in their stored
    order (by step, then call); every record of a selected step is exported. npy and csv need a
    fixed per-record shape; a ragged field exports to h5. A .npy export also writes
    PATH.steps.csv listing each row's step and call. The command names every file it wrote. A
    csv of more than 16,384 columns (the most spreadsheet programs open) gets a warning.

    --format arrow writes a directory that datasets.load_from_disk reads: one column per field
    (named HANDLE/FIELD), rows aligned on (rank, step, call) and sample, plus columns step, call,
    rank, sample. It needs pip install "hookline[datasets]".

    \b
    Example:
      hookline export runs/baseline 'grads[fc1]' grad_out.0 --format npy --out g.npy
      hookline export runs/baseline 'outputs[fc1]' --format npy --out o.npy
      hookline export runs/baseline 'outputs[fc2]' outputs.0 --format csv --out o.csv --steps 0:100
      hookline export runs:/0a1b... 'grads[fc1]' grad_out.0 --format h5 --out g.h5 --steps 0,10,20
      hookline export runs/baseline --format arrow --out acts --field 'outputs[fc1]/outputs.0'
    """
    if fmt == "arrow":
        from .export_arrow import export_arrow_command

        export_arrow_command(run, handle, field, refs, rows, out, steps_spec, force, quiet, tracking_uri)
        return
    if handle is None:
        raise click.UsageError(f"--format {fmt} exports one field: give HANDLE (and FIELD when the handle has several)")
    if Path(out).is_dir():
        raise click.UsageError(f"--out {out!r} is a directory; --format {fmt} writes a file")
    from hookline.storage.words import plural

    mask_fn = parse_steps(steps_spec)
    outp = output_path(out, "--out")
    for p in (outp, outp.with_name(outp.name + ".steps.csv")) if fmt == "npy" else (outp,):
        if p.exists() and not force:
            raise click.ClickException(f"output {str(p)!r} exists; pass --force to overwrite it")
    from hookline.storage.blocks import damage_note
    from hookline.storage.reader import LocalSource

    r = open_run_arg(run, tracking_uri)

    # (the MLflow download cache of a runs:/ RUN is written only through hookline)
    root = Path(r.source.root).resolve() if isinstance(r.source, LocalSource) else None
    if root is not None and outp.resolve().is_relative_to(root):
        # (--force included: overwriting a file of the run would destroy recorded data)
        raise click.ClickException(
            f"output {out!r} is inside the run directory {str(root)!r}; export to a path outside it"
        )
    h = r[handle]
    field = field if field is not None else _only_field(handle, h.fields)
    note = damage_note(h)
    if note and field not in h.fields:
        raise click.ClickException(f"cannot export {field!r}: {note}")
    if note:
        click.echo(f"warning: {note}", err=True)  # (exported: the readable records)
    f = h[field]
    steps, calls = f.steps, f.calls
    idx = np.arange(len(steps))
    if mask_fn is not None:
        idx = idx[mask_fn(steps)]
        if idx.size == 0:
            have = f"{steps.min()}..{steps.max()}" if steps.size else "none"
            raise click.ClickException(
                f"--steps {steps_spec!r} selects no record of {handle} {field} (its steps: {have})"
            )
    shape = f.shape
    if shape is None and fmt in ("npy", "csv"):
        raise click.ClickException(
            f"field {field!r} of {handle!r} is ragged (its shape varies across records); "
            f"export it with --format h5"
        )
    if idx.size == 0:
        raise click.ClickException(f"{handle} {field} has no records to export")
    if fmt == "csv":
        _warn_wide_csv(out, shape)
    tmp = outp.with_name(outp.name + ".partial")
    with progress_bar(f"exporting {field}", int(idx.size), quiet=quiet) as advance:
        try:
            if fmt == "npy":
                _npy(f, idx, shape, tmp, advance)
            elif fmt == "csv":
                _csv(f, idx, steps, calls, shape, tmp, advance)
            else:
                _h5(run, handle, field, f, idx, steps, calls, shape, tmp, advance)
            os.replace(tmp, outp)
        except OSError as e:
            if e.filename is not None and Path(e.filename) == tmp:
                # (the message names the file the user asked for, not the temporary one)
                raise click.ClickException(f"cannot write {out!r}: {e.strerror or e}") from e
            raise
        finally:
            if tmp.exists():
                tmp.unlink()
    written = _npy_steps(out, outp, idx, steps, calls) if fmt == "npy" else out
    click.echo(safe_text(f"exported {plural(int(idx.size), 'record')} of {handle} {field} to {written}"))


#: Columns beyond which a csv export warns: the most that Excel and LibreOffice Calc open.
WIDE_CSV_COLUMNS = 16_384


def _npy_steps(out: str, outp: Path, idx: np.ndarray, steps: np.ndarray, calls: np.ndarray) -> str:
    """Write ``PATH.steps.csv`` beside a .npy export (the step and call of each row); the files
    written, as the command reports them."""
    side = outp.with_name(outp.name + ".steps.csv")
    with open(side, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["row", "step", "call"])
        for k, i in enumerate(idx):
            w.writerow([k, int(steps[i]), int(calls[i])])
    return f"{out} and {side} (the step and call of each row)"


def _only_field(handle: str, fields: list[str]) -> str:
    """The handle's one field, for an export that names none."""
    if len(fields) == 1:
        return fields[0]
    if not fields:
        raise click.ClickException(f"handle {handle!r} has no fields to export (no readable records)")
    raise click.ClickException(
        f"handle {handle!r} has {len(fields)} fields ({', '.join(fields)}): name the one to export, "
        f"e.g. hookline export RUN {shlex.quote(handle)} {shlex.quote(fields[0])} --format ... --out ...")


def _warn_wide_csv(out: str, shape: tuple[int, ...]) -> None:
    """Warn before writing a csv too wide for spreadsheet programs (one column per value)."""
    values = int(np.prod(shape)) if shape else 1
    if values + 2 > WIDE_CSV_COLUMNS:
        click.echo(safe_text(
            f"warning: {out} gets {values + 2:,} columns (step, call and {values:,} values per record), more "
            f"than the {WIDE_CSV_COLUMNS:,} that spreadsheet programs open; --format npy or h5 keeps each "
            "record's shape"), err=True)


def _npy(f: Field, idx: np.ndarray, shape: tuple[int, ...], tmp: Path, advance: Callable[[int], None]) -> None:
    from hookline.storage.blocks import iter_records

    dtype = np.dtype(f.dtype)
    arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(int(idx.size), *shape))
    for pos, rec in iter_records(f, idx):
        arr[pos] = rec
        advance(1)
    arr.flush()
    del arr


def _csv(f: Field, idx: np.ndarray, steps: np.ndarray, calls: np.ndarray, shape: tuple[int, ...], tmp: Path,
         advance: Callable[[int], None]) -> None:
    from hookline.storage.blocks import iter_records

    n = int(np.prod(shape)) if shape else 1
    if shape:
        cols = ["_".join(map(str, ix)) for ix in np.ndindex(*shape)]
    else:
        cols = ["value"]
    with open(tmp, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["step", "call", *cols])
        for pos, rec in iter_records(f, idx):
            i = idx[pos]
            vals = np.asarray(rec).reshape(n)
            w.writerow([int(steps[i]), int(calls[i]), *vals.tolist()])
            advance(1)


def _h5(run: str, handle: str, field: str, f: Field, idx: np.ndarray, steps: np.ndarray, calls: np.ndarray,
        shape: tuple[int, ...] | None, tmp: Path, advance: Callable[[int], None]) -> None:
    import h5py

    from hookline.storage.blocks import iter_records

    dtype = np.dtype(f.dtype)
    with h5py.File(tmp, "w") as out:
        out.attrs["source_run"] = str(run)
        out.attrs["handle"] = handle
        out.attrs["field"] = field
        out.attrs["dtype"] = f.dtype_name
        out.create_dataset("step", data=steps[idx])
        out.create_dataset("call", data=calls[idx])
        if shape is not None:
            ds = out.create_dataset("data", shape=(int(idx.size), *shape), dtype=dtype,
                                    chunks=(1, *shape) if shape else None)
            for pos, rec in iter_records(f, idx):
                ds[pos] = rec
                advance(1)
        else:
            g = out.create_group("data")
            g.attrs["ragged"] = True
            width = max(6, len(str(idx.size)))
            for pos, rec in iter_records(f, idx):
                g.create_dataset(f"{pos:0{width}d}", data=np.asarray(rec))
                advance(1)
