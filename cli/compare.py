"""``hookline compare RUN_A RUN_B``: per handle, field and common step: cosine, rel_l2, norm_ratio,
or the representation metrics cka and procrustes (also over all steps at once)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import click

from .options import (
    CONTEXT_SETTINGS,
    clean_json,
    console,
    echo_json,
    esc,
    plain,
    print_table,
    fmt_num,
    json_option,
    open_run_arg,
    output_path,
    progress_bar,
    quiet_option,
    safe_text,
    tracking_uri_option,
)

if TYPE_CHECKING:  # (storage is imported when a command runs: `hookline --help` stays fast)
    import numpy as np

    from hookline.storage.compare import FieldComparison

#: ``hookline.storage.compare.METRICS`` (the default) and ``ALL_METRICS``, spelled out so that
#: building the CLI imports no storage.
DEFAULT_METRICS = ("cosine", "rel_l2", "norm_ratio")
METRIC_CHOICES = DEFAULT_METRICS + ("cka", "procrustes")
#: Metrics compared as samples x features matrices (a value over all steps too; --plot: heatmap).
REPRESENTATION = ("cka", "procrustes")
#: At most this many panels (handles) in a --plot.
MAX_PANELS = 24

_STATUS_TEXT = {
    "ok": "[green]ok[/]",
    "missing_in_a": "[yellow]missing in A[/]",
    "missing_in_b": "[yellow]missing in B[/]",
    "shape_mismatch": "[red]shape mismatch[/]",
    "no_common_steps": "[yellow]no common steps[/]",
    "unreadable": "[red]unreadable[/]",
    "no_records": "[yellow]no records[/]",
}


def _extreme_ratio(values: np.ndarray) -> float | None:
    """The norm ratio farthest from 1 (0 and inf included: one norm was zero)."""
    import numpy as np

    v = np.asarray(values, float)
    v = v[~np.isnan(v) & (v >= 0)]
    if v.size == 0:
        return None
    if (v == 0).any() or np.isinf(v).any():
        return float(np.inf) if np.isinf(v).any() else 0.0
    return float(v[np.argmax(np.abs(np.log(v)))])


def _worst(r: FieldComparison, metric: str) -> float | None:
    """Worst step: min cosine / cka, max rel_l2 (inf when a's norm was zero) / procrustes,
    norm_ratio farthest from 1."""
    import numpy as np

    v = np.asarray(r.values.get(metric, ()), float)
    if metric == "norm_ratio":
        return _extreme_ratio(v)
    if metric == "rel_l2" and np.isposinf(v).any():
        return float("inf")
    s = r.summary(metric)
    return s["min"] if metric in ("cosine", "cka") else s["max"]


def nonfinite_note(r: FieldComparison, metrics: Sequence[str]) -> str | None:
    """A note when some compared steps gave no finite value (a zero or NaN record)."""
    import numpy as np

    compared = np.ones(len(r.steps), bool)
    compared[list(r.mismatch_positions)] = False  # skipped for their shapes: said by the message
    n = int(compared.sum())
    bad = {m: int((~np.isfinite(np.asarray(r.values.get(m, ()), float)[compared])).sum()) for m in metrics}
    bad = {m: k for m, k in bad.items() if k}
    if not n or not bad:
        return None
    parts = ", ".join(f"{m} {k}" for m, k in bad.items())
    return (f"of {n} compared steps, these gave no finite value (a record with norm 0, or NaN/inf "
            f"in the data): {parts}; means leave them out, --json shows them as null")


def metric_cell(r: FieldComparison, metric: str) -> str:
    """Table cell of one metric: mean over steps / worst step (cosine, cka: min; rel_l2,
    procrustes: max; norm_ratio: the value farthest from 1)."""
    s = r.summary(metric)
    worst = _worst(r, metric)
    if s["mean"] is None and worst is None:
        return "-"
    return f"{fmt_num(s['mean'], 3) if s['mean'] is not None else '-'}/{fmt_num(worst, 3)}"


HEADERS = {"cosine": "cosine\nmean/min", "rel_l2": "rel_l2\nmean/max", "norm_ratio": "norm_ratio\nmean/extreme",
           "cka": "cka\nmean/min", "procrustes": "procrustes\nmean/max"}


def overall_cell(r: FieldComparison, metric: str) -> str:
    """Table cell of a representation metric over all common steps at once."""
    v = r.overall.get(metric)
    return "-" if v is None or v != v else fmt_num(v, 3)


def _plain_status(r: FieldComparison) -> str:
    from rich.text import Text

    text = _STATUS_TEXT.get(r.status, esc(r.status))
    if r.status == "ok" and r.mismatched:
        text = f"ok, {r.mismatched} skipped"
    return Text.from_markup(text).plain


def render_table(results: Sequence[FieldComparison], metrics: Sequence[str], *, title: str | None = None) -> None:
    """Print one row per result: handle, field, compared steps, one cell per metric, status."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True, title=title, title_justify="left", pad_edge=False)
    table.add_column("handle", overflow="fold", min_width=12)
    table.add_column("field", overflow="fold", min_width=8)
    table.add_column("steps", justify="right", no_wrap=True)
    for m in metrics:
        table.add_column(HEADERS[m], justify="right", no_wrap=True)
        if m in REPRESENTATION:
            table.add_column(f"{m}\nall steps", justify="right", no_wrap=True)
    with_status = any(r.status != "ok" or r.mismatched for r in results)
    if with_status:
        # (as wide as the longest status: rich dropped the end of a folded "shape mismatch")
        table.add_column("status", overflow="fold", min_width=max(len(_plain_status(r)) for r in results))
    for r in results:
        missing = r.status in ("missing_in_a", "missing_in_b", "unreadable", "no_records")
        cells = [plain(r.handle), plain(r.field or "-"), "-" if missing else str(len(r.steps))]
        for m in metrics:
            cells += [metric_cell(r, m)] + ([overall_cell(r, m)] if m in REPRESENTATION else [])
        status = _STATUS_TEXT.get(r.status, esc(r.status))
        if r.status == "ok" and r.mismatched:
            status = f"[yellow]ok, {r.mismatched} skipped[/]"
        if with_status:
            cells.append(status)
        table.add_row(*cells)
    print_table(table)


def render_problems(results: Sequence[FieldComparison], metrics: Sequence[str] = DEFAULT_METRICS) -> None:
    """Print one note per result message and per metric with non-finite values."""
    c = console()
    for r in results:
        for msg in (r.message, nonfinite_note(r, metrics)):
            if msg:
                where = r.handle + (f" {r.field}" if r.field else "")
                c.print(f"[yellow]note:[/] {esc(where)}: {esc(msg)}", soft_wrap=True, markup=True, highlight=False)


@click.command(context_settings=CONTEXT_SETTINGS,
               short_help='Compare two runs: cosine, rel_l2, norm_ratio, cka, procrustes per handle/field/step.')
@click.argument("run_a", metavar="RUN_A")
@click.argument("run_b", metavar="RUN_B")
@click.option("--handle", "handles", multiple=True, metavar="GLOB",
              help="Compare only handles matching GLOB (* any characters, ? one; brackets are "
                   "literal, e.g. 'grads[*]'). Repeatable.")
@click.option("--field", "fields", multiple=True, metavar="NAME",
              help="Compare only this field (glob allowed, e.g. 'grad_out.*'). Repeatable.")
@click.option("--metric", "metrics", multiple=True, type=click.Choice(METRIC_CHOICES),
              help="Metric(s) to show and plot (default: cosine, rel_l2, norm_ratio). cka and "
                   "procrustes compare records as samples x features matrices. Repeatable.")
@click.option("--plot", "plot", type=click.Path(dir_okay=False, writable=True), metavar="PNG",
              help="Write a plot: one panel per handle (at most 24), metric over steps; with only "
                   "cka/procrustes, a layers x steps heatmap per metric.")
@click.option("--map", "maps", multiple=True, metavar="OLD=NEW",
              help="Rename before pairing handles, in both runs: a handle id, or a dotted module-name "
                   "prefix (NEW empty drops it), e.g. --map model.transformer=transformer. Repeatable.")
@click.option("--sample-dims", "sample_dims", type=click.IntRange(min=0), default=None, metavar="K",
              help="cka/procrustes: the first K axes of a record hold samples (default: all but the last).")
@click.option("--rank", "rank", type=click.IntRange(min=0), default=None, metavar="R",
              help="Distributed runs: compare only rank R of both runs.")
@click.option("--rank-a", "rank_a", type=click.IntRange(min=0), default=None, metavar="R",
              help="Distributed runs: use only rank R of RUN_A (overrides --rank).")
@click.option("--rank-b", "rank_b", type=click.IntRange(min=0), default=None, metavar="R",
              help="Distributed runs: use only rank R of RUN_B (overrides --rank).")
@json_option
@quiet_option
@tracking_uri_option
def compare(run_a: str, run_b: str, handles: tuple[str, ...], fields: tuple[str, ...],
            metrics: tuple[str, ...], plot: str | None, maps: tuple[str, ...], sample_dims: int | None,
            rank: int | None, rank_a: int | None, rank_b: int | None, as_json: bool, quiet: bool,
            tracking_uri: str | None) -> None:
    """Compare two runs per handle, field and common step.

    For every (step, call) recorded in both runs, with a = RUN_A's record and b = RUN_B's:
    cosine = a.b/(|a||b|), rel_l2 = |a-b|/|a|, norm_ratio = |b|/|a|. A step with several
    calls is compared call by call. --metric cka / procrustes read each record as samples x
    features (tokens of a (batch, seq, d) output are samples): linear CKA (1: same
    representation up to rotation and scale) and the angular Procrustes distance (0: same),
    per step and over all common steps at once. The table shows, per metric, mean/worst over
    the steps (worst: min cosine/cka, max rel_l2/procrustes, norm_ratio farthest from 1); --json
    and --plot give every step. Handles pair on their names; when none pairs, a wrapper prefix
    (model., module., _orig_mod.) is dropped and a note says so; --map makes it explicit.
    Handles or fields present in only one run, differing shapes, runs without common
    steps and unreadable files are reported in the table (exit code 0). Streams: runs larger
    than memory compare fine. RUN is a run directory, runs:/<id>, or an MLflow run id.
    Distributed runs pair records on (step, call, rank); --rank / --rank-a / --rank-b compare
    chosen ranks instead (e.g. rank 0 against rank 1 of the same run).

    \b
    Example:
      hookline compare runs/lr0.01 runs/lr0.1
      hookline compare runs/a runs/b --handle 'grads[*]' --field grad_out.0 --plot cmp.png
      hookline compare runs:/0a1b... runs:/9f8e... --metric cosine --json
      hookline compare runs/ddp runs/ddp --rank-a 0 --rank-b 1
      hookline compare runs/hf runs/lightning --metric cka --plot cka.png
      hookline compare runs/a runs/b --metric cka --map model.transformer=transformer
    """
    from hookline.storage.compare import CompareResult, align_handles, iter_compare, parse_rename

    ms = tuple(dict.fromkeys(metrics)) or DEFAULT_METRICS
    rename = parse_rename(maps)
    if plot:
        plot = _plot_path(plot)  # checked before the comparison's work
    ra = open_run_arg(run_a, tracking_uri)
    rb = open_run_arg(run_b, tracking_uri)
    for run, label, opened, r in ((run_a, "RUN_A", ra, rank if rank_a is None else rank_a),
                                  (run_b, "RUN_B", rb, rank if rank_b is None else rank_b)):
        if r is not None and list(opened.ranks) == [None]:
            raise click.UsageError(
                f"{label} {run!r} is not a distributed run (it has no ranks); --rank, --rank-a and "
                f"--rank-b apply to runs recorded under torch.distributed")
    hsel = list(handles) or None
    fsel = list(fields) or None
    alignment = align_handles(ra, rb, rename)
    total = _require_common(ra, rb, hsel, fsel, alignment)
    with progress_bar("comparing", total, quiet=quiet or as_json) as advance:
        results = list(iter_compare(ra, rb, handles=hsel, fields=fsel, metrics=ms, progress=advance,
                                    rank_a=rank if rank_a is None else rank_a,
                                    rank_b=rank if rank_b is None else rank_b, rename=rename,
                                    sample_dims=sample_dims))
    res = CompareResult(run_a, run_b, ms, results, alignment.note)
    if not as_json:  # the table first: a plot that fails to write does not take it along
        render_table(results, ms, title=f"A = {esc(run_a)}\nB = {esc(run_b)}")
        if alignment.note:
            console().print(f"[yellow]note:[/] {esc(alignment.note)}", soft_wrap=True, markup=True, highlight=False)
        render_problems(results, ms)
    if plot:
        _write_plot(results, plot, ms, run_a, run_b)
    if as_json:
        d = res.to_dict()
        d["plot"] = plot
        echo_json(clean_json(d))
    elif plot:
        click.echo(f"plot written to {safe_text(plot)}")


class NothingCompared(click.ClickException):
    """The two runs (as selected) have no handle or field in common: exit status 1, one line."""


def _write_plot(results: Sequence[FieldComparison], plot: str, ms: tuple[str, ...], run_a: str, run_b: str) -> None:
    """Line panels per handle, or (only cka/procrustes) a layers x steps heatmap per metric."""
    from hookline.storage.words import plural

    from .plot import plot_comparison, plot_heatmap

    if all(m in REPRESENTATION for m in ms):
        plot_heatmap(results, plot, metrics=ms, label_a=run_a, label_b=run_b)
        return
    plot_comparison(results, plot, metrics=ms, label_a=run_a, label_b=run_b, max_panels=MAX_PANELS)
    plotted = {r.handle for r in results if r.status == "ok" and len(r.steps)}
    if len(plotted) > MAX_PANELS:
        click.echo(f"warning: the plot shows the first {MAX_PANELS} of {plural(len(plotted), 'handle')}; "
                   f"select fewer with --handle", err=True)


def _require_common(ra: Any, rb: Any, hsel: list[str] | None, fsel: list[str] | None, alignment: Any) -> int:
    """Refuse a comparison in which every selected handle (or field) exists in one run only: it
    would be a table of "missing" rows that compares nothing. Returns the number of record pairs
    to compare (for the progress bar)."""
    from hookline.storage.compare import count_pairs, plan as plan_items

    items = plan_items(ra, rb, handles=hsel, fields=fsel, alignment=alignment)
    if any(where not in ("a", "b") for _h, _f, where in items):
        return count_pairs(ra, rb, handles=hsel, fields=fsel, alignment=alignment)
    from hookline.storage.words import plural

    what = "field" if fsel is not None else "handle"

    def names(run: Any) -> str:
        hs = list(run.handles)
        return plural(len(hs), "handle") + (f" ({', '.join(hs[:3])}{', ...' if len(hs) > 3 else ''})" if hs else "")

    raise NothingCompared(f"nothing compared: the runs have no {what} in common (A has {names(ra)}, "
                          f"B has {names(rb)}); compare runs that recorded the same modules, or pair "
                          f"names with --map OLD=NEW")


def _plot_path(plot: str) -> str:
    """The file the plot goes to (``.png`` added when PLOT has no extension, as matplotlib does),
    after checking that its folder can be written."""
    from pathlib import Path

    p = Path(plot)
    if not p.suffix:
        p = p.with_name(p.name + ".png")
    return str(output_path(p, "--plot"))
