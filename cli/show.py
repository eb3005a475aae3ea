"""``hookline show RUN [HANDLE]``: what a run holds; with HANDLE, per-field statistics."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import click
import numpy as np

from .options import (
    CONTEXT_SETTINGS,
    clean_json,
    console,
    echo_json,
    esc,
    plain,
    print_table,
    fmt_num,
    human_bytes,
    json_option,
    open_run_arg,
    progress_bar,
    quiet_option,
    safe_text,
    tracking_uri_option,
)

if TYPE_CHECKING:  # (storage is imported when a command runs: `hookline --help` stays fast)
    from hookline.storage.reader import Field, Run


def _shape(fld: Field) -> list[int] | None:
    return list(fld.shape) if fld.shape is not None else None


def handle_info(run: Run, hid: str) -> dict[str, Any]:
    """What ``show`` lists of one handle: its module, records, steps, ranks, bytes on disk, fields
    (name, dtype, shape, records) and a warning when records are unreadable."""
    from hookline.storage.blocks import damage_note

    h = run[hid]
    warning = damage_note(h)  # (first: it opens the files, their damage is reported once, here)
    fields = []
    for name in h.fields:
        f = h[name]
        shape = _shape(f)
        fields.append({
            "name": name,
            "dtype": f.dtype_name,
            "shape": shape,
            "ragged": shape is None,
            "records": len(f),
        })
    steps = h.steps
    ranks = sorted(int(r) for r in np.unique(h.ranks) if r >= 0) or None
    return {
        "handle": hid,
        "module_name": h.module_name,
        "module_type": h.module_type,
        "category": h.category,
        "records": int(len(steps)),
        "steps": [int(steps.min()), int(steps.max())] if steps.size else None,
        "n_steps": int(np.unique(steps).size),
        "ranks": ranks,
        "bytes": h.file_bytes,
        "fields": fields,
        "warning": warning,
    }


def listed_info(run: Run, hid: str) -> dict[str, Any]:
    """What ``show`` lists of one handle of a remote (MLflow) run, from its manifest(s) alone: no
    handle file is downloaded. Per-field record counts and the number of distinct steps are in
    the files only (``None`` here); byte sizes come from the artifact listing."""
    entries = [(m, m["handles"][hid]) for m in run.manifests if hid in m.get("handles", {})]
    h = run[hid]
    records = sum(int(e.get("records") or 0) for _, e in entries)
    spans = [e["steps"] for _, e in entries if isinstance(e.get("steps"), list) and len(e["steps"]) == 2]
    fields: dict[str, dict] = {}
    for _, e in entries:
        for name, f in (e.get("fields") or {}).items():
            fields.setdefault(name, f if isinstance(f, dict) else {})
    ranks = sorted({int(m["rank"]) for m, e in entries if m.get("rank") is not None and e.get("records")}) or None
    return {
        "handle": hid,
        "module_name": h.module_name,
        "module_type": h.module_type,
        "category": h.category,
        "records": records,
        "steps": [min(a for a, _ in spans), max(b for _, b in spans)] if spans and records else None,
        "n_steps": None,
        "ranks": ranks,
        "bytes": h.file_bytes,
        "fields": [{"name": name, "dtype": f.get("dtype"), "shape": f.get("shape"), "ragged": f.get("shape") is None,
                    "records": None} for name, f in fields.items()],
        "warning": None,
    }


#: Handles ``show`` lists by default (each listed handle's files are opened; the rest of a huge
#: run is summed from its manifests: one ``stat`` per handle).
SHOW_LIMIT = 50


def run_totals(run: Run) -> dict[str, Any]:
    """Handles, records (the manifests' counts) and bytes of the handle files on disk (None for a
    remote run) of the whole run, without opening a handle file."""
    shared = getattr(run.source, "shared_manifests", None)  # (read-only; no copy of a huge manifest)
    records = sum(int(e.get("records") or 0) for m in (shared() if shared is not None else run.manifests)
                  for e in m["handles"].values())
    files_bytes = getattr(run.source, "files_bytes", None)
    return {"handles": len(run), "records": records, "bytes": files_bytes() if files_bytes is not None else None}


def field_stats(fld: Field, advance: Callable[[int], None] = lambda n=1: None) -> dict[str, Any]:
    """Streamed statistics over all records: element min/max/mean and per-record L2 norms."""
    from hookline.storage.blocks import iter_records

    n_el = 0
    total = 0.0
    lo, hi = math.inf, -math.inf
    norms: list[float] = []
    nonfinite = 0
    for _, rec in iter_records(fld):
        x = np.asarray(rec)
        if x.dtype.kind == "c":
            x = np.abs(x)
        x = x.astype(np.float64, copy=False).ravel()
        fin = np.isfinite(x)
        if not fin.all():
            nonfinite += int((~fin).sum())
            x = x[fin]
        if x.size:
            lo = min(lo, float(x.min()))
            hi = max(hi, float(x.max()))
            total += float(x.sum())
            n_el += x.size
        norms.append(float(np.sqrt(np.dot(x, x))))
        advance(1)
    nrm = np.asarray(norms)
    return {
        "min": lo if n_el else None,
        "max": hi if n_el else None,
        "mean": total / n_el if n_el else None,
        "norm_mean": float(nrm.mean()) if nrm.size else None,
        "norm_min": float(nrm.min()) if nrm.size else None,
        "norm_max": float(nrm.max()) if nrm.size else None,
        "norm_last": float(nrm[-1]) if nrm.size else None,
        "nonfinite": nonfinite,
    }


def _short_type(t: str | None) -> str:
    if not t:
        return "-"
    return t.rsplit(".", 1)[-1]


def _shape_text(f: dict) -> str:
    return "ragged" if f["shape"] is None else "×".join(map(str, f["shape"])) or "scalar"


@click.command(context_settings=CONTEXT_SETTINGS, short_help='Show what a run holds; with HANDLE, per-field statistics.')
@click.argument("run", metavar="RUN")
@click.argument("handle", metavar="[HANDLE]", required=False)
@click.option("--limit", type=click.IntRange(min=0), default=SHOW_LIMIT, show_default=True,
              help="List at most this many handles (0: all); a run with more is summarised: the title "
                   "counts every handle, record and byte (from its manifest, no file opened).")
@json_option
@quiet_option
@tracking_uri_option
def show(run: str, handle: str | None, limit: int, as_json: bool, quiet: bool, tracking_uri: str | None) -> None:
    """Show the handles, fields, dtypes, shapes, records, steps and bytes of a run.

    With HANDLE, also per-field statistics over all records (streamed): element min, max and
    mean, and the per-record L2 norm (mean, max, last; --json adds min). A run of more than
    --limit handles (default 50) lists the first ones and sums up all of them (--json:
    "handles" holds the listed ones, "total" the sums). RUN is a run directory,
    runs:/<id>, or an MLflow run id. A ragged field (shape varies across records) shows its
    shape as "ragged".

    \b
    Example:
      hookline show runs/baseline
      hookline show runs/huge --limit 0
      hookline show runs/baseline 'grads[fc1]'
      hookline show runs:/0a1b2c... --json
    """
    from hookline.storage.reader import LocalSource

    r = open_run_arg(run, tracking_uri)
    if handle is None:
        # (a remote run's handles are listed from its manifests: no handle file is downloaded)
        describe = handle_info if isinstance(r.source, LocalSource) else listed_info
        ids = r.handles
        shown = ids if not limit or len(ids) <= limit else ids[:limit]
        infos = [describe(r, h) for h in shown]
        total = run_totals(r) if len(shown) < len(ids) else None
        for i in infos:
            if i["warning"]:
                click.echo(f"warning: {safe_text(i['warning'])}", err=True)
        if as_json:
            echo_json(clean_json({"run": run, "status": r.status, "meta": r.meta, "handles": infos,
                                  **({"total": total} if total else {})}))
            return
        _print_run(run, infos, r.status, r.meta, total)
        return

    info = handle_info(r, handle)  # unknown handle -> UnknownNameError -> one-line error
    h = r[handle]
    if info["warning"]:
        if info["records"] == 0:
            raise click.ClickException(f"handle {handle!r} of run {run!r} has no readable records: {info['warning']}")
        click.echo(f"warning: {safe_text(info['warning'])}", err=True)
    total = sum(f["records"] for f in info["fields"])
    with progress_bar(f"reading {handle}", total, quiet=quiet or as_json) as advance:
        for f in info["fields"]:
            f.update(field_stats(h[f["name"]], advance))
    if as_json:
        echo_json(clean_json({"run": run, **info}))
        return
    _print_handle(run, info)


def _print_run(run: str, infos: list[dict], status: str | None = None, meta: dict | None = None,
               summary: dict | None = None) -> None:
    from hookline.storage.words import plural
    from rich import box
    from rich.table import Table

    total = sum(i["bytes"] or 0 for i in infos) if summary is None else summary["bytes"]
    title = f"{esc(run)}: {plural(len(infos), 'handle')}, {human_bytes(total)}"
    if summary is not None:
        title = (f"{esc(run)}: {plural(summary['handles'], 'handle')}, {plural(summary['records'], 'record')}, "
                 f"{human_bytes(total)}; the first {len(infos)} listed (--limit 0 lists all)")
    bits = [f"status {status}"] if status else []
    meta = meta or {}
    for key in ("mlflow_run_id", "torch_version", "every", "steps"):
        if meta.get(key) is not None:
            bits.append(f"{key} {meta[key]}")
    if meta.get("found_inf_steps"):  # Recorder(grad_scaler=...): steps the optimizer skipped
        bits.append(f"grad scaler found inf/NaN at steps {meta['found_inf_steps']}")
    extra = {k: v for k, v in meta.items()
             if k not in ("mlflow_run_id", "torch_version", "every", "steps", "found_inf_steps")}
    if extra:
        bits.append("meta " + ", ".join(f"{k}={v}" for k, v in list(extra.items())[:6]))
    if bits:
        console().print(safe_text("; ".join(bits)), soft_wrap=True, markup=False, highlight=False)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True, title=title, title_justify="left",
                  pad_edge=False)
    table.add_column("handle", overflow="fold", min_width=12)
    table.add_column("type", overflow="fold")
    table.add_column("field", overflow="fold", min_width=8)
    table.add_column("dtype", no_wrap=True)
    table.add_column("shape", no_wrap=True)
    table.add_column("records", justify="right", no_wrap=True)
    table.add_column("steps", justify="right", no_wrap=True)
    table.add_column("bytes", justify="right", no_wrap=True)
    for i in infos:
        fields = i["fields"] or [{"name": "-", "dtype": "-", "shape": [], "records": 0}]
        for k, f in enumerate(fields):
            first = k == 0
            table.add_row(
                plain(i["handle"]) if first else "",
                plain(_short_type(i["module_type"])) if first else "",
                plain(f["name"]),
                plain(f["dtype"]),
                _shape_text(f) if f["name"] != "-" else "-",
                "-" if f["records"] is None else str(f["records"]),
                _steps_text(i) if first else "",
                human_bytes(i["bytes"]) if first else "",
            )
    print_table(table)
    if summary is not None:
        console().print(f"... and {plural(summary['handles'] - len(infos), 'more handle')} (hookline show RUN HANDLE "
                        f"for one; --limit 0 lists all)", soft_wrap=True, markup=False, highlight=False)


def _steps_text(i: dict) -> str:
    if not i["steps"]:
        return "-"
    a, b = i["steps"]
    text = str(a) if a == b else f"{a}..{b}" + (f" ({i['n_steps']})" if i["n_steps"] is not None else "")
    if i.get("ranks"):
        text += f", ranks {','.join(map(str, i['ranks']))}"
    return text


def _print_handle(run: str, info: dict) -> None:
    from hookline.storage.words import plural
    from rich import box
    from rich.table import Table

    c = console()
    c.print(f"[bold]{esc(info['handle'])}[/] in {esc(run)}", soft_wrap=True)
    c.print(safe_text(
        f"module {info['module_name'] or '-'} ({info['module_type'] or '-'}), {info['category'] or '-'}; "
        f"{plural(info['records'], 'record')}, steps {_steps_text(info)}, {human_bytes(info['bytes'])}"),
        soft_wrap=True, markup=False,
    )
    fields = Table(box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True, pad_edge=False)
    fields.add_column("field", overflow="fold", min_width=8)
    fields.add_column("dtype", no_wrap=True)
    fields.add_column("shape", no_wrap=True)
    fields.add_column("records", justify="right", no_wrap=True)
    for f in info["fields"]:
        fields.add_row(plain(f["name"]), plain(f["dtype"]), _shape_text(f), str(f["records"]))
    c.print(fields)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True, pad_edge=False)
    table.add_column("field", overflow="fold", min_width=8)
    for col in ("min", "max", "mean", "norm mean", "norm max", "norm last"):
        table.add_column(col, justify="right", no_wrap=True)
    for f in info["fields"]:
        table.add_row(plain(f["name"]), fmt_num(f["min"]), fmt_num(f["max"]), fmt_num(f["mean"]),
                      fmt_num(f["norm_mean"]), fmt_num(f["norm_max"]), fmt_num(f["norm_last"]))
    c.print("\nstatistics over all records (element min/max/mean; per-record L2 norm mean/max/last):",
            soft_wrap=True, markup=False)
    c.print(table)
