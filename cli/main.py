"""The ``hookline`` click group; commands live one per file in this package."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import click

try:
    __version__ = version("hookline")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(context_settings=CONTEXT_SETTINGS)
@click.version_option(__version__, "-V", "--version", prog_name="hookline")
def cli() -> None:
    """Record, inspect and compare what happens inside PyTorch models.

    \b
    Example:
      hookline demo            # train a toy model twice, record, compare, plot
    """


@cli.command(context_settings=CONTEXT_SETTINGS)
def demo() -> None:
    """Train a small model twice, record activations and gradients, compare the runs.

    \b
    Example:
      hookline demo
    """
    click.echo("hookline demo: not yet available in this version (see README).")


if __name__ == "__main__":  # pragma: no cover
    cli()
