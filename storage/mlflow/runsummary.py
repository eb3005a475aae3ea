"""The run summary artifact ``hookline/summary.html``: what a run recorded, previewable on the
MLflow run page (its artifact viewer shows HTML).

One self-contained page (pictures inline as PNG data URIs, drawn with matplotlib's Agg backend):
a table of every handle (module, type, category, fields, per-record shapes, dtypes, records,
steps, bytes), and per field two pictures over the training steps: the L2 norm of each record
(the norms the writer stored) and the distribution of its values as a heat strip (columns:
steps, rows: value bins, shade: share of the values). The strip is drawn from the field's
``.hist`` records for ``mode="stats"`` handles, else from a bounded sample of records: at most
:data:`STRIP_COLUMNS` records spread over the steps, at most :data:`SAMPLE_VALUES` values of each
and :data:`SAMPLE_BYTES` read per field. At most :data:`MAX_PICTURES` fields get pictures
(the table names them all).
"""

from __future__ import annotations

import base64
import html
import io
import logging
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

from .client import short_error

__all__ = ["MAX_PICTURES", "SAMPLE_BYTES", "SAMPLE_VALUES", "STRIP_COLUMNS", "SummaryPage", "summary_name",
           "write_summary"]

log = logging.getLogger("hookline.mlflow")

#: Fields with pictures, at most (in handle order); the table lists every field.
MAX_PICTURES = 32
#: Records sampled per field for its value strip (spread evenly over its records).
STRIP_COLUMNS = 48
#: Values taken from one sampled record (evenly strided).
SAMPLE_VALUES = 1 << 16
#: Bytes read per field for its strip, at most.
SAMPLE_BYTES = 64 << 20
_BINS = 40


def summary_name(rank: int | None) -> str:
    """The artifact's file name: ``summary.html``, or ``summary.rank<r>.html`` for one rank's pass."""
    return "summary.html" if rank is None else f"summary.rank{rank}.html"


def _sizes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _steps_text(steps: np.ndarray) -> str:
    if not steps.size:
        return "none"
    distinct = np.unique(steps)
    return f"{distinct.size} ({int(distinct[0])}..{int(distinct[-1])})"


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _sparkline(steps: np.ndarray, values: np.ndarray) -> bytes:
    """A PNG of ``values`` over ``steps``, without axes (the page prints the ranges beside it:
    matplotlib's axis layout costs ~20x the drawing)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3.6, 0.9))
    ax = fig.add_axes((0.01, 0.06, 0.98, 0.88))
    ax.plot(steps, values, linewidth=1.2, marker="." if len(values) < 64 else None, color="#1f77b4")
    ax.set_axis_off()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=72, metadata={"Software": None})
    return buf.getvalue()


def _heat(shares: np.ndarray) -> bytes:
    """A PNG of ``shares[bins, columns]`` (log shade; the lowest bin at the bottom), scaled up."""
    from matplotlib.image import imsave

    img = np.log10(shares + 1e-4)
    img = np.repeat(np.repeat(img, 2, axis=0), max(1, 240 // img.shape[1]), axis=1)
    buf = io.BytesIO()
    imsave(buf, img, cmap="magma", format="png", origin="lower", metadata={"Software": None})
    return buf.getvalue()


def _sample_values(field: Any) -> tuple[np.ndarray, list[np.ndarray]]:
    """Steps and value samples (float64, finite) of up to :data:`STRIP_COLUMNS` records."""
    n = len(field)
    shape = field.shape if field.shape is not None else field.record_shape(0)  # (ragged: the first record's)
    per = max(1, int(np.prod(shape)) * field.dtype.itemsize)
    cols = max(2, min(STRIP_COLUMNS, SAMPLE_BYTES // per))
    picks = np.unique(np.linspace(0, n - 1, min(n, cols)).round().astype(np.int64))
    samples = []
    for i in picks:
        v = np.asarray(field[int(i)]).ravel()
        v = v[:: max(1, v.size // SAMPLE_VALUES)]
        v = np.abs(v) if np.iscomplexobj(v) else v
        v = v.astype(np.float64)
        samples.append(v[np.isfinite(v)])
    return field.steps[picks], samples


def _strip(field: Any, hist: Any | None, edges: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(steps, bin edges, shares[bins, columns])`` of a field's value distribution."""
    if hist is not None and len(hist):
        picks = np.unique(np.linspace(0, len(hist) - 1, min(len(hist), STRIP_COLUMNS)).round().astype(np.int64))
        counts = np.stack([np.asarray(hist[int(i)], np.float64).ravel() for i in picks], axis=1)
        e = np.asarray(edges, np.float64)
        if e.size != counts.shape[0] + 1:
            return None
        return hist.steps[picks], e, counts / np.maximum(counts.sum(axis=0, keepdims=True), 1)
    steps, samples = _sample_values(field)
    pooled = np.concatenate(samples) if samples else np.zeros(0)
    if not pooled.size:
        return None
    lo, hi = np.percentile(pooled, [0.5, 99.5])
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    e = np.linspace(lo, hi, _BINS + 1)
    counts = np.stack([np.histogram(np.clip(s, lo, hi), e)[0] for s in samples], axis=1).astype(np.float64)
    return steps, e, counts / np.maximum(counts.sum(axis=0, keepdims=True), 1)


def _pictures(field: Any, hist: Any | None, edges: Any) -> str:
    """One field's pictures as table cells: its norm over steps, its value strip."""
    steps = field.steps
    norms = field.norms() if len(field) else np.zeros(0)
    cells = []
    if norms.size:
        finite = norms[np.isfinite(norms)]
        rng = f"{finite.min():.4g} .. {finite.max():.4g}" if finite.size else "not finite"
        cells.append(f'<td><img alt="L2 norm per record" src="{_data_uri(_sparkline(steps, norms))}"><br>'
                     f"L2 norm {rng}, steps {int(steps[0])} .. {int(steps[-1])}</td>")
    strip = _strip(field, hist, edges)
    if strip is not None:
        st, e, shares = strip
        cells.append(f'<td><img alt="value distribution per step" src="{_data_uri(_heat(shares))}"><br>'
                     f"values {e[0]:.4g} (bottom) .. {e[-1]:.4g} (top), steps {int(st[0])} .. {int(st[-1])}</td>")
    return "".join(cells)


def _field_row(handle: Any, name: str) -> list[str]:
    f = handle[name]
    shape = "ragged" if f.shape is None else "x".join(map(str, f.shape)) or "scalar"
    return [name, shape, f.torch_dtype_name, str(len(f)), _steps_text(f.steps)]


def _handle_section(handle: Any, nbytes: int | None, budget: list[int]) -> str:
    """The table rows and pictures of one handle (``budget[0]``: pictures left)."""
    rows = []
    pictures = []
    meta = handle.meta
    fields = [n for n in handle.fields if not n.endswith(".hist")]
    for name in handle.fields:
        rows.append(_field_row(handle, name))
    for name in fields:
        if budget[0] <= 0:
            break
        base = name[: -len(".norm")] if meta.get("mode") == "stats" and name.endswith(".norm") else None
        if meta.get("mode") == "stats" and base is None:
            continue  # (a stats handle: one picture per tensor, from its .norm and .hist)
        hist = handle[f"{base}.hist"] if base is not None and f"{base}.hist" in handle.fields else None
        budget[0] -= 1
        pictures.append(f"<tr><th>{html.escape(base or name)}</th>{_pictures(handle[name], hist, meta.get('hist_edges'))}</tr>")
    head = (f"<h2>{html.escape(handle.id)}</h2><p>module <code>{html.escape(handle.module_name or '(root)')}</code> "
            f"({html.escape(handle.module_type)}), {html.escape(handle.category)}, {len(handle)} records, "
            f"steps {_steps_text(handle.steps)}, {_sizes(nbytes) if nbytes is not None else 'size unknown'}</p>")
    if handle.problems:  # (damaged files are skipped: the page says so, as the reader does)
        head += "".join(f"<p><b>unreadable:</b> {html.escape(p)}</p>" for p in handle.problems)
    table = "<table><tr><th>field</th><th>shape per record</th><th>dtype</th><th>records</th><th>steps</th></tr>"
    table += "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows) + "</table>"
    strips = ("<table class='pics'><tr><th>field</th><th>norm over steps</th><th>value distribution over steps "
              "(columns: steps, rows: value bins, bright: more values)</th></tr>" + "".join(pictures) + "</table>"
              if pictures else "")
    return head + table + strips


_STYLE = ("body{font-family:sans-serif;font-size:14px;margin:16px}table{border-collapse:collapse;margin:4px 0 8px}"
          "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}h2{font-size:16px;margin:20px 0 4px}"
          "img{max-width:100%;image-rendering:pixelated}.pics td{font-size:12px;color:#444}")


def write_summary(run_dir: str | Path, out: str | Path, *, rank: int | None = None) -> Path:
    """Write the summary page of a run directory.

    Args:
        run_dir: the run directory (read with :func:`~hookline.storage.open_run`).
        out: the HTML file to write.
        rank: only this rank's handles (None: every rank).

    Returns:
        ``out`` as a Path.
    """
    from ..reader import open_run

    with open_run(run_dir) as run:
        budget = [MAX_PICTURES]
        sections = []
        n_fields = 0
        for hid in run.handles:
            if rank is not None and rank not in run.ranks:
                break
            try:
                handle = run.handle(hid, rank) if rank is not None else run[hid]
            except KeyError:
                continue  # (another rank's handle: never read, its writer may still be writing)
            sections.append(_handle_section(handle, handle.file_bytes, budget))
            n_fields += len(handle.fields)
        note = ("" if budget[0] > 0 else
                f"<p>Pictures of the first {MAX_PICTURES} fields; every field is in the tables.</p>")
        page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>hookline run</title><style>{_STYLE}"
                f"</style></head><body><h1>hookline run: {len(sections)} handles, {n_fields} fields"
                f"{'' if rank is None else f' (rank {rank})'}</h1>"
                f"<p>status {html.escape(run.status)}; recorded with torch "
                f"{html.escape(str(run.meta.get('torch_version', '?')))}, every {run.meta.get('every', '?')}; "
                f"read it with <code>open_run(\"runs:/&lt;run id&gt;\")</code> or download the .h5 files.</p>{note}"
                + "".join(sections) + "</body></html>")
    path = Path(out)
    path.write_text(page, encoding="utf-8")
    return path


class SummaryPage:
    """A sync pass's summary page, drawn on a thread of its own (while the handle files upload)
    into a temporary folder.

    ``with page as path:`` waits for it and removes the folder afterwards; ``path`` is None when
    the page could not be made (a warning: the files, tags and metrics are what a sync must
    deliver). :meth:`discard` lets a page the pass will not upload go (the folder is removed once
    it is drawn).

    Args:
        run_dir: the run directory.
        rank: only this rank's handles (None: every rank).
    """

    def __init__(self, run_dir: Path, rank: int | None) -> None:
        self._run_dir, self._rank = run_dir, rank
        self._thread: threading.Thread | None = None
        self._path: Path | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._lock = threading.Lock()
        self._done = self._dropped = False

    def start(self) -> None:
        """Start drawing (once)."""
        if self._thread is not None:
            return
        self._tmp = tempfile.TemporaryDirectory(prefix="hookline-summary-")
        self._thread = threading.Thread(target=self._draw, name="hookline-summary", daemon=True)
        self._thread.start()

    def _draw(self) -> None:
        try:
            self._path = write_summary(self._run_dir, Path(self._tmp.name) / summary_name(self._rank), rank=self._rank)
        except Exception as e:  # noqa: BLE001
            log.warning("hookline: no summary page for %r: %s", str(self._run_dir), short_error(e))
        with self._lock:
            self._done = True
            if self._dropped:
                self._tmp.cleanup()

    def discard(self) -> None:
        """The page is not needed (idempotent; a no-op after ``with``)."""
        with self._lock:
            if self._tmp is None or self._dropped:
                return
            self._dropped = True
            if self._done:
                self._tmp.cleanup()

    def __enter__(self) -> Path | None:
        self.start()
        self._thread.join()  # type: ignore[union-attr]
        return self._path

    def __exit__(self, *exc: Any) -> None:
        self.discard()
