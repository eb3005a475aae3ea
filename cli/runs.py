"""``hookline runs``: MLflow runs that hold hookline data, with handle counts and sizes."""

from __future__ import annotations

import datetime as _dt
import re
from typing import Any

import click

from hookline.storage.mlflow.keys import VERSION_TAG
from hookline.storage.words import plural

from .options import (
    CONTEXT_SETTINGS,
    clean_json,
    console,
    echo_json,
    esc,
    human_bytes,
    json_option,
    plain,
    print_table,
    quiet_mlflow_logs,
    safe_text,
    tracking_uri_option,
)

#: Every run the MLflow adapter synced carries the hookline.version run tag.
BASE_FILTER = f"tags.`{VERSION_TAG}` LIKE '%'"

_HANDLES = re.compile(r"^hookline\.handles(?:-rank\d+)?$")
_BYTES = re.compile(r"^hookline\.bytes(?:-rank\d+)?$")
_HAS = re.compile(r"^hookline\.has\.(.+)$")
_STATUS = {"FINISHED": "done", "RUNNING": "running", "FAILED": "failed", "KILLED": "killed",
           "SCHEDULED": "sched"}


def run_info(run: Any, experiments: dict[str, str]) -> dict[str, Any]:
    """The JSON record of one MLflow run (see docs/cli.md)."""
    tags = dict(run.data.tags)
    handles = sum(int(v) for k, v in tags.items() if _HANDLES.match(k) and str(v).isdigit())
    records = 0
    size = 0
    for k, v in tags.items():
        if not k.startswith("hookline.") or "/" not in k:
            continue
        name = k.rsplit("/", 1)[1]
        if name == "records" and str(v).isdigit():
            records += int(v)
        elif name == "synced":
            head = str(v).split(":", 1)[0]
            if head.isdigit():
                size += int(head)
    if any(_BYTES.match(k) for k in tags):  # (runs synced by earlier builds have per-file `synced` tags only)
        size = sum(int(v) for k, v in tags.items() if _BYTES.match(k) and str(v).isdigit())
    types = sorted(m.group(1) for k in tags if (m := _HAS.match(k)))
    info = run.info
    start = _dt.datetime.fromtimestamp(info.start_time / 1000, _dt.timezone.utc).isoformat(timespec="seconds") \
        if info.start_time else None
    return {
        "run_id": info.run_id,
        "run_name": getattr(info, "run_name", None) or tags.get("mlflow.runName"),
        "experiment_id": info.experiment_id,
        "experiment": experiments.get(info.experiment_id),
        "status": info.status,
        "start_time": start,
        "hookline_version": tags.get(VERSION_TAG),
        "handles": handles,
        "records": records,
        "bytes": size,
        "module_types": types,
        "uri": f"runs:/{info.run_id}",
    }


@click.command(context_settings=CONTEXT_SETTINGS, short_help='List MLflow runs that hold hookline data.')
@click.option("--experiment", "experiment", metavar="NAME", default=None,
              help="Only runs of this MLflow experiment (default: all active experiments).")
@click.option("--filter", "filter_string", metavar="FILTER", default=None,
              help="Extra MLflow search filter, ANDed with the hookline one, e.g. "
                   "\"params.lr = '0.1'\" or \"tags.`hookline.has.Linear` = 'true'\".")
@click.option("--max-results", type=click.IntRange(min=1), default=100, show_default=True,
              help="At most this many runs (newest first).")
@tracking_uri_option
@json_option
def runs(experiment: str | None, filter_string: str | None, max_results: int, tracking_uri: str | None,
         as_json: bool) -> None:
    """List MLflow runs that hold hookline data, with handle counts, records and sizes.

    The table shows run id, name, status, start time (UTC, month-day hour:minute), handle count
    and size; --json adds the experiment, record counts and module types. A run holds hookline
    data when it carries the hookline.version tag, which the MLflow
    adapter sets when a Recorder (with mlflow_run_id=...) or `hookline sync` registers a run
    directory. Open one with `hookline show runs:/<run_id>`.

    \b
    Example:
      hookline runs
      hookline runs --experiment hookline-demo
      hookline runs --filter "params.lr = '0.1'" --json
      hookline runs --tracking-uri http://127.0.0.1:5000
    """
    quiet_mlflow_logs()
    from hookline.storage.mlflow.client import connect

    client = connect(tracking_uri, existing=True)
    uri = client.tracking_uri
    filt = BASE_FILTER + (f" AND {filter_string}" if filter_string else "")
    found, experiments = _search(client, experiment, filter_string, filt, max_results)
    infos = [run_info(r, experiments) for r in found]
    if as_json:
        echo_json(clean_json({"tracking_uri": uri, "filter": filt, "runs": infos}))
        return
    _print_runs(infos, experiment, uri, filt)


def _search(client: Any, experiment: str | None, filter_string: str | None, filt: str,
            max_results: int) -> tuple[list[Any], dict[str, str]]:
    """The runs that match ``filt`` (newest first) and the experiments searched (id -> name)."""
    from hookline.storage.errors import TrackingError, UnknownNameError

    uri = client.tracking_uri
    try:
        if experiment is not None:
            exp = client.get_experiment_by_name(experiment)
            if exp is None:
                names = [e.name for e in client.search_experiments()]
                raise UnknownNameError(
                    f"MLflow experiment {experiment!r} not found at {uri}; "
                    f"experiments: {', '.join(names[:10]) or '(none)'}"
                )
            exps = [exp]
        else:
            exps = list(client.search_experiments())
        experiments = {e.experiment_id: e.name for e in exps}
        found = client.search_runs(list(experiments), filter_string=filt, max_results=max_results,
                                   order_by=["attributes.start_time DESC"]) if experiments else []
    except UnknownNameError:
        raise
    except Exception as e:  # noqa: BLE001 - MLflow's own errors: bad filter, server down
        msg = " ".join(str(e).split())
        if filter_string and getattr(e, "error_code", "") == "INVALID_PARAMETER_VALUE":
            raise click.ClickException(f"bad --filter {filter_string!r}: {msg[:300]}") from e
        raise TrackingError(f"searching runs at {uri} failed: {msg[:300]}") from e
    return found, experiments


def _print_runs(infos: list[dict[str, Any]], experiment: str | None, uri: str, filt: str) -> None:
    """The runs table (or a hint when there are none)."""
    c = console()
    if not infos:
        where = f"experiment {experiment!r}" if experiment else "any experiment"
        c.print(safe_text(f"no runs with hookline data in {where} at {uri} (filter: {filt})"), soft_wrap=True,
                highlight=False, markup=False)
        c.print("record one with Recorder(..., mlflow_run_id=...), `hookline sync`, or try `hookline demo`.",
                soft_wrap=True, highlight=False, markup=False)
        return
    from rich.measure import Measurement

    exps = {i["experiment"] for i in infos}
    one_exp = len(exps) == 1
    where = f" in experiment {esc(next(iter(exps)))}" if one_exp else ""
    title = f"{plural(len(infos), 'run')} with hookline data{where} at {esc(uri)}"
    table = _table(infos, one_exp, title, stacked=False)
    if Measurement.get(c, c.options.update_width(10_000), table).maximum > c.width:  # (names would fold: own line)
        table = _table(infos, one_exp, title, stacked=True)
    print_table(table)


def _table(infos: list[dict[str, Any]], one_exp: bool, title: str, *, stacked: bool) -> Any:
    """The runs table; ``stacked`` puts each run's name (and experiment) on a line under its id."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True, pad_edge=False,
                  title=title, title_justify="left")
    table.add_column("run id / name" if stacked else "run id", no_wrap=not stacked, overflow="fold", min_width=32)
    if not stacked:
        table.add_column("name", overflow="fold", min_width=8)
        if not one_exp:
            table.add_column("experiment", overflow="fold", min_width=10)
    table.add_column("status", no_wrap=True)
    table.add_column("started", no_wrap=True)
    table.add_column("handles", justify="right", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    for i in infos:
        started = (i["start_time"] or "-").replace("T", " ").replace("+00:00", "")[5:16]
        if stacked:
            second = f"{i['run_name'] or '-'}" + ("" if one_exp else f" ({i['experiment']})")
            row = [Text(f"{i['run_id']}\n{safe_text(second)}")]
        else:
            row = [plain(i["run_id"]), plain(i["run_name"])] + ([] if one_exp else [plain(i["experiment"])])
        status = _STATUS.get(i["status"], str(i["status"]).lower())
        row += [plain(status), plain(started), str(i["handles"]), human_bytes(i["bytes"])]
        table.add_row(*row)
    return table
