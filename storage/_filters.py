"""HDF5 compression filters in one place: spec names, h5py arguments, per-field rules, plugins."""

from __future__ import annotations

import fnmatch
from typing import Any, Iterable, Mapping

from .errors import HookTypeError, InvalidArgumentError

__all__ = ["CompressionRules", "compression_kwargs", "ensure_filters"]

#: Compression levels each leveled filter accepts (HDF5's deflate; zstd's range in hdf5plugin).
_LEVELS = {"gzip": range(0, 10), "zstd": range(1, 23)}
#: Filters HDF5 has without a plugin (a dataset using another one needs hdf5plugin to read).
_BUILTIN_FILTERS = {"gzip", "lzf", "shuffle", "fletcher32", "scaleoffset", "szip"}


def compression_kwargs(spec: str | None) -> dict[str, Any]:
    """h5py ``create_dataset`` keyword arguments for a compression spec.

    Args:
        spec: ``None``/``"none"``, ``"gzip"`` (level 4) or ``"gzip-<level>"``, ``"lzf"``,
            ``"zstd"`` (level 1) or ``"zstd-<level>"``, ``"lz4"``.

    Raises:
        InvalidArgumentError: an unknown name or level.
        ImportError: zstd or lz4 without hdf5plugin installed.
    """
    if spec is None or spec == "none":
        return {}
    name, dash, level = spec.partition("-")
    levels = _LEVELS.get(name)
    if levels is not None and dash:
        if not (level.isdigit() and int(level) in levels):
            raise InvalidArgumentError(
                f"compression {spec!r}: the {name} level must be an integer from {levels[0]} to {levels[-1]}, "
                f"got {level!r} (e.g. '{name}-{levels[0]}')")
    elif name in ("lzf", "lz4") and dash:
        raise InvalidArgumentError(f"compression {spec!r}: {name} has no level; use {name!r}")
    if name == "gzip":
        return {"compression": "gzip", "compression_opts": int(level or 4), "shuffle": False}
    if name == "lzf":
        return {"compression": "lzf"}
    if name in ("zstd", "lz4"):
        import hdf5plugin

        if name == "zstd":
            return dict(hdf5plugin.Zstd(clevel=int(level or 1)))
        return dict(hdf5plugin.LZ4())

    raise InvalidArgumentError(
        f"unknown compression {spec!r}; use None, 'gzip', 'gzip-<0..9>', 'lzf', 'zstd', 'zstd-<1..22>' or 'lz4'"
    )


class CompressionRules:
    """A writer's ``compression`` argument, checked: one spec for every field, or a mapping from
    field-name glob pattern to spec (first match wins; no match: uncompressed).

    Args:
        compression: ``None``, a spec (see :func:`compression_kwargs`) or a mapping of patterns
            to specs.

    Raises:
        HookTypeError: a spec that is not a str or None.
        InvalidArgumentError: an unknown spec (ImportError: zstd/lz4 without hdf5plugin).
    """

    def __init__(self, compression: str | Mapping[str, str | None] | None) -> None:
        specs = compression.values() if isinstance(compression, Mapping) else [compression]
        for s in specs:
            if s is not None and not isinstance(s, str):
                raise HookTypeError(
                    f"compression must be None, a name such as 'gzip' or 'zstd-3', or a mapping of field "
                    f"patterns to names, got {type(s).__name__} {s!r:.60}")
            compression_kwargs(s)  # raises for unknown names / missing hdf5plugin
        self._rules = dict(compression) if isinstance(compression, Mapping) else compression
        self._cache: dict[str, str | None] = {}

    def for_field(self, name: str) -> str | None:
        """The spec of field ``name`` (looked up once per name)."""
        try:
            return self._cache[name]
        except KeyError:
            pass
        rules = self._rules
        if isinstance(rules, dict):
            spec = next((v for pat, v in rules.items() if fnmatch.fnmatchcase(name, pat)), None)
        else:
            spec = rules
        self._cache[name] = spec
        return spec


def ensure_filters(filters: Iterable[str]) -> None:
    """Import hdf5plugin (it registers the Zstd/LZ4 filters) when a dataset's ``filters`` include
    one HDF5 lacks built in; a no-op when hdf5plugin is not installed (reading then fails in HDF5,
    naming the filter)."""
    if all(k in _BUILTIN_FILTERS for k in filters):
        return
    try:
        import hdf5plugin  # noqa: F401
    except ImportError:
        pass
