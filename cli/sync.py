"""``hookline sync RUN_DIR [--run-id ID]``: upload a run directory to an MLflow run (idempotent)."""

from __future__ import annotations

import logging
import os
import shlex

import click

from .options import CONTEXT_SETTINGS, clean_json, console, echo_json, json_option, safe_text, tracking_uri_option


@click.command(context_settings=CONTEXT_SETTINGS, short_help='Upload a run directory to an MLflow run (idempotent).')
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path(file_okay=False))
@click.option("--run-id", "run_id", default=None, metavar="ID",
              help="The MLflow run to register the data with (default: the run the directory was "
                   "recorded for, from its manifest).")
@tracking_uri_option
@json_option
def sync(run_dir: str, run_id: str | None, tracking_uri: str | None, as_json: bool) -> None:
    """Upload a run directory's files, tags and norm metrics to an existing MLflow run.

    The run is the one the directory was recorded for (its manifest names it when the Recorder
    had an ``mlflow_run_id``, as the framework callbacks do); --run-id names another, or one for
    a run recorded without MLflow.

    Safe to repeat: files already uploaded (same size and SHA-256) and metric points already
    logged are skipped, so nothing is duplicated. Use it when the tracking server was down
    during training, or to attach a run recorded without MLflow. Exits non-zero when
    something failed (run it again to retry).

    \b
    Example:
      hookline sync runs/baseline
      hookline sync runs/baseline --run-id 0a1b2c3d4e5f60718293a4b5c6d7e8f9
      hookline sync runs/baseline --run-id 0a1b... --tracking-uri http://127.0.0.1:5000
    """
    from hookline.storage import recorded_run_id
    from hookline.storage import sync as storage_sync
    from hookline.storage.words import plural

    if not os.path.isdir(run_dir):
        raise click.ClickException(f"run directory {run_dir!r} does not exist")
    if run_id is None:
        run_id = recorded_run_id(run_dir)
        if run_id is None:
            raise click.ClickException(
                f"run directory {run_dir!r} was recorded without an MLflow run, so it names none to upload "
                f"to: pass one with --run-id ID (hookline sync {shlex.quote(run_dir)} --run-id ID)")
    log = logging.getLogger("hookline.mlflow")
    level = log.level
    log.setLevel(logging.ERROR)  # the command prints the report's errors itself, once
    try:
        report = storage_sync(run_dir, run_id, tracking_uri=tracking_uri)
    finally:
        log.setLevel(level)
    d = {
        "run_id": report.run_id,
        "ok": report.ok,
        "uploaded": list(report.uploaded),
        "skipped": list(report.skipped),
        "metrics": report.metrics,
        "tags": report.tags,
        "errors": list(report.errors),
        "seconds": round(report.seconds, 3),
    }
    if as_json:
        echo_json(clean_json(d))
    else:
        c = console()
        c.print(safe_text(
            f"synced {run_dir} to MLflow run {report.run_id}: {plural(len(report.uploaded), 'file')} uploaded, "
            f"{len(report.skipped)} already there, {report.metrics} metric points, {report.tags} tags "
            f"({report.seconds:.1f} s)"), soft_wrap=True, highlight=False, markup=False,
        )
        for e in report.errors:
            c.print(f"error: {safe_text(e)}", soft_wrap=True, highlight=False, markup=False)
    if not report.ok:
        where = "listed in the JSON" if as_json else "listed above"
        raise click.ClickException(
            f"{plural(len(report.errors), 'sync error')} for {run_dir!r} ({where}); "
            f"fix {'it' if len(report.errors) == 1 else 'them'} and run the command again"
        )
