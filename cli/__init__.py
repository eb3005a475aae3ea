"""hookline.cli: the ``hookline`` command line (click)."""
