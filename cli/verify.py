"""``hookline verify RUN [--repair]``: check (and repair) a run directory, or check an MLflow run's hookline data."""

from __future__ import annotations

import os
from typing import Any

import click

from .options import (
    CONTEXT_SETTINGS,
    clean_json,
    console,
    echo_json,
    json_option,
    quiet_mlflow_logs,
    run_source,
    safe_text,
    tracking_uri_option,
)


class RepairedDamage(click.ClickException):
    """``verify --repair`` made the run consistent but found damage (moved files aside, gave records
    up, or reset manifest entries that led outside the run):
    exit status 3 (1 means problems remain)."""

    exit_code = 3


@click.command(context_settings=CONTEXT_SETTINGS, short_help='Check a run directory or an MLflow run; --repair fixes what it can.')
@click.argument("run_dir", metavar="RUN")
@click.option("--repair", is_flag=True,
              help="Repair what can be repaired (finish interrupted files, rebuild the manifest); "
                   "a local run directory only.")
@tracking_uri_option
@json_option
def verify(run_dir: str, repair: bool, tracking_uri: str | None, as_json: bool) -> None:
    """Check a run directory or an MLflow run: which handles and records survived, what is broken.

    Opens every handle file, checks every record's index entries, counts readable records, and
    compares them with the manifest. With --repair, also fixes what can be fixed (e.g. after the
    training process was killed). Exit status: 0 nothing found; 1 problems remain; 3 repaired,
    but files were moved to the quarantine or records lost.

    An MLflow run (runs:/ID, or a bare run id) is checked on a fresh download of its hookline
    files into a temporary folder, removed afterwards; it cannot be repaired in MLflow: repair
    the run directory it came from and run `hookline sync` again.

    \b
    Example:
      hookline verify runs/baseline
      hookline verify runs/crashed --repair
      hookline verify runs/baseline --json
      hookline verify runs:/0a1b2c3d4e5f60718293a4b5c6d7e8f9 --tracking-uri http://127.0.0.1:5000
    """
    remote = not os.path.isdir(run_dir)
    report = _check(run_dir, repair, tracking_uri)
    if as_json:
        echo_json(clean_json(report.to_dict()))
    else:
        # (the report names handles and files of the run: escaped, its own line breaks kept)
        console().print(safe_text(report, keep="\n"), soft_wrap=True, highlight=False, markup=False)
    if not report.ok and remote:
        raise click.ClickException(
            f"MLflow run {report.path!r} has problems: upload the run directory again (hookline sync RUN_DIR; "
            "hookline verify RUN_DIR --repair first if it has problems too)")
    if not report.ok:
        raise click.ClickException(
            f"run directory {run_dir!r} has problems"
            + ("" if repair else "; run `hookline verify --repair` to fix what can be fixed")
        )
    if not report.clean:
        raise RepairedDamage(f"run directory {run_dir!r} was repaired, but damage was found "
                             f"({report.damage_found()}); "
                             f"it now verifies clean")


def _check(run: str, repair: bool, tracking_uri: str | None) -> Any:
    """The :class:`~hookline.storage.VerifyReport` of a run directory, or of an MLflow run's
    downloaded files."""
    from hookline.storage import verify as storage_verify
    from hookline.storage import verify_mlflow_run

    if os.path.isdir(run):
        return storage_verify(run, repair=repair)
    if os.path.exists(run):
        raise click.ClickException(f"run directory {run!r} is not a directory; pass the folder a Recorder wrote")
    try:
        src = run_source(run)
    except click.ClickException:
        raise click.ClickException(
            f"run directory {run!r} does not exist (nor is it a runs:/<id> URI or an MLflow run id)") from None
    if repair:
        raise click.ClickException(
            f"--repair works on a local run directory, not on the MLflow run {run!r}: repair the run "
            "directory it was synced from (hookline verify RUN_DIR --repair), then hookline sync it again")
    quiet_mlflow_logs()
    return verify_mlflow_run(src, tracking_uri=tracking_uri)
