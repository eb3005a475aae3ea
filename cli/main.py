"""The ``hookline`` click group; commands live one per file in this package."""

from __future__ import annotations

import click

from .errors import HooklineGroup
from .options import CONTEXT_SETTINGS


def _version() -> str:
    """hookline's installed version (read only for ``-V``: package metadata costs ~40 ms)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hookline")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(f"hookline, version {_version()}")
        ctx.exit()


@click.group(cls=HooklineGroup, context_settings=CONTEXT_SETTINGS)
@click.option("-V", "--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show the version and exit.")
def cli() -> None:
    """Record, inspect and compare what happens inside PyTorch models.

    RUN arguments accept a run directory, an MLflow URI runs:/<run_id>, or a bare MLflow run id
    (resolved with --tracking-uri, default MLflow's own). Errors print one line on stderr and exit
    with a non-zero code; set HOOKLINE_DEBUG=1 for a traceback. Reference: docs/cli.md.

    \b
    Example:
      hookline demo            # train a toy model twice, record, compare, plot
      hookline runs            # MLflow runs that hold hookline data
      hookline show RUN        # what a run holds
      hookline compare RUN_A RUN_B --plot cmp.png
    """


def _register() -> None:
    from .compare import compare
    from .demo import demo
    from .export import export
    from .runs import runs
    from .show import show
    from .sync import sync
    from .verify import verify

    for cmd in (demo, runs, show, compare, export, verify, sync):
        cli.add_command(cmd)


_register()


if __name__ == "__main__":  # pragma: no cover
    cli()
