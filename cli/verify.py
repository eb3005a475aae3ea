"""``hookline verify RUN_DIR [--repair]``: check (and repair) a run directory."""

from __future__ import annotations

import os

import click

from .options import CONTEXT_SETTINGS, clean_json, console, echo_json, json_option, safe_text


class RepairedDamage(click.ClickException):
    """``verify --repair`` made the run consistent but found damage (moved files aside, gave records
    up, or reset manifest entries that led outside the run):
    exit status 3 (1 means problems remain)."""

    exit_code = 3


@click.command(context_settings=CONTEXT_SETTINGS, short_help='Check a run directory; --repair fixes what it can.')
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path(file_okay=False))
@click.option("--repair", is_flag=True,
              help="Repair what can be repaired (finish interrupted files, rebuild the manifest).")
@json_option
def verify(run_dir: str, repair: bool, as_json: bool) -> None:
    """Check a run directory: which handles and records survived, what is broken.

    Opens every handle file, checks every record's index entries, counts readable records, and
    compares them with the manifest. With --repair, also fixes what can be fixed (e.g. after the
    training process was killed). Exit status: 0 nothing found; 1 problems remain; 3 repaired,
    but files were moved to the quarantine or records lost.

    \b
    Example:
      hookline verify runs/baseline
      hookline verify runs/crashed --repair
      hookline verify runs/baseline --json
    """
    from hookline.storage import verify as storage_verify

    if not os.path.isdir(run_dir):
        raise click.ClickException(f"run directory {run_dir!r} does not exist")
    report = storage_verify(run_dir, repair=repair)
    if as_json:
        echo_json(clean_json(report.to_dict()))
    else:
        # (the report names handles and files of the run: escaped, its own line breaks kept)
        console().print(safe_text(report, keep="\n"), soft_wrap=True, highlight=False, markup=False)
    if not report.ok:
        raise click.ClickException(
            f"run directory {run_dir!r} has problems"
            + ("" if repair else "; run `hookline verify --repair` to fix what can be fixed")
        )
    if not report.clean:
        raise RepairedDamage(f"run directory {run_dir!r} was repaired, but damage was found "
                             f"({report.damage_found()}); "
                             f"it now verifies clean")
