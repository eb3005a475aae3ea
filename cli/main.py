"""The ``hookline`` click group; commands live one per file in this package."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import click

from .errors import HooklineGroup
from .options import CONTEXT_SETTINGS

try:
    __version__ = version("hookline")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"


@click.group(cls=HooklineGroup, context_settings=CONTEXT_SETTINGS)
@click.version_option(__version__, "-V", "--version", prog_name="hookline")
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
