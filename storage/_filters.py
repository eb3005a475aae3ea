"""HDF5 filters in one place: compression spec names, per-chunk checksums, h5py arguments,
per-field rules, plugins.

A *spec* is a string naming what a field's chunks go through (docs/storage.md#compression):
a codec (``"zstd"``, ``"blosc2-zstd-1-bitshuffle"``, ...) or ``"none"``, optionally followed by
``"+checksum"`` (HDF5's fletcher32 filter: every chunk carries a checksum that HDF5 checks on
every read). :func:`compression_kwargs` turns a spec into ``create_dataset`` arguments;
:class:`CompressionRules` maps field names to specs.
"""

from __future__ import annotations

import fnmatch
import os
from typing import Any, Iterable, Mapping

from .errors import HookTypeError, InvalidArgumentError

__all__ = ["CompressionRules", "compression_kwargs", "ensure_filters", "parse_spec", "spec_of_dataset", "spec_of_filters",
           "BLOSC2_CODECS", "BLOSC2_DEFAULT", "CHECKSUM_SUFFIX", "has_checksum"]

#: Compression levels each leveled filter accepts (HDF5's deflate; zstd's range in hdf5plugin).
_LEVELS = {"gzip": range(0, 10), "zstd": range(1, 23)}
#: Filters HDF5 has without a plugin (a dataset using another one needs hdf5plugin to read).
_BUILTIN_FILTERS = {"gzip", "lzf", "shuffle", "fletcher32", "scaleoffset", "szip"}
#: Codecs inside Blosc2 (hdf5plugin.Blosc2 ``cname``), and their level range.
BLOSC2_CODECS = ("lz4", "lz4hc", "zstd", "blosclz", "zlib")
_BLOSC2_LEVELS = range(0, 10)
#: Blosc2's pre-filters by spec word (hdf5plugin.Blosc2 ``filters``: 0 none, 1 byte, 2 bit shuffle).
_BLOSC2_SHUFFLES = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}
#: What a bare ``"blosc2"`` means: the codec the table in docs/performance.md picked.
BLOSC2_DEFAULT = "blosc2-lz4-5-bitshuffle"
#: Appended to a spec to add HDF5's fletcher32 checksum to every chunk (``"none+checksum"``).
CHECKSUM_SUFFIX = "+checksum"
_USAGE = ("use None, 'none', 'gzip', 'gzip-<0..9>', 'lzf', 'zstd', 'zstd-<1..22>', 'lz4', 'blosc2' or "
          "'blosc2-<codec>[-<0..9>][-<shuffle|bitshuffle|noshuffle>]' (codec one of "
          f"{', '.join(BLOSC2_CODECS)}), each optionally followed by '{CHECKSUM_SUFFIX}'")


def has_checksum(spec: str | None) -> bool:
    """Whether a spec asks for per-chunk checksums."""
    return spec is not None and spec.endswith(CHECKSUM_SUFFIX)


def parse_spec(spec: str | None) -> tuple[str, dict[str, Any]]:
    """Check a spec and split it into its codec part and the filter description.

    Returns:
        ``(codec, info)``: ``codec`` is the spec without the checksum suffix (``"none"`` when
        uncompressed); ``info`` has ``name`` (``"none"``, ``"gzip"``, ``"lzf"``, ``"zstd"``,
        ``"lz4"``, ``"blosc2"``), ``level``, for Blosc2 ``cname`` and ``shuffle``, and ``checksum``.

    Raises:
        InvalidArgumentError: an unknown name, word or level (the message quotes the spec and
            lists the accepted forms).
    """
    if spec is None:
        return "none", {"name": "none", "level": None, "checksum": False}
    checksum = has_checksum(spec)
    codec = spec[: -len(CHECKSUM_SUFFIX)] if checksum else spec
    if "+" in codec:
        raise InvalidArgumentError(f"unknown compression {spec!r}: the only suffix is {CHECKSUM_SUFFIX!r}; {_USAGE}")
    name, dash, level = codec.partition("-")
    info: dict[str, Any] = {"name": name, "level": None, "checksum": checksum}
    if name == "none" and not dash:
        return "none", info
    if name == "blosc2":
        info.update(_parse_blosc2(spec, BLOSC2_DEFAULT if not dash else codec))
        return codec, info
    levels = _LEVELS.get(name)
    if levels is not None and dash:
        if not (level.isdigit() and int(level) in levels):
            raise InvalidArgumentError(
                f"compression {spec!r}: the {name} level must be an integer from {levels[0]} to {levels[-1]}, "
                f"got {level!r} (e.g. '{name}-{levels[0]}')")
        info["level"] = int(level)
    elif name in ("lzf", "lz4") and dash:
        raise InvalidArgumentError(f"compression {spec!r}: {name} has no level; use {name!r}")
    elif name not in ("gzip", "lzf", "zstd", "lz4"):
        raise InvalidArgumentError(f"unknown compression {spec!r}; {_USAGE}")
    if info["level"] is None and levels is not None:
        info["level"] = 4 if name == "gzip" else 1
    return codec, info


def _parse_blosc2(spec: str, codec: str) -> dict[str, Any]:
    """``blosc2-<cname>[-<level>][-<shuffle word>]`` (defaults: level 1, byte shuffle)."""
    words = codec.split("-")[1:]
    cname = words.pop(0) if words else ""
    if cname not in BLOSC2_CODECS:
        raise InvalidArgumentError(f"compression {spec!r}: unknown Blosc2 codec {cname!r}; use one of "
                                   f"{', '.join(BLOSC2_CODECS)} (e.g. {BLOSC2_DEFAULT!r})")
    level, shuffle = 1, "shuffle"
    if words and words[0].isdigit():
        level = int(words.pop(0))
        if level not in _BLOSC2_LEVELS:
            raise InvalidArgumentError(f"compression {spec!r}: the Blosc2 level must be an integer from 0 to 9, "
                                       f"got {level}")
    if words and words[0] in _BLOSC2_SHUFFLES:
        shuffle = words.pop(0)
    if words:
        raise InvalidArgumentError(f"compression {spec!r}: unexpected {'-'.join(words)!r}; a Blosc2 spec is "
                                   f"'blosc2-<codec>[-<0..9>][-<shuffle|bitshuffle|noshuffle>]'")
    return {"cname": cname, "level": level, "shuffle": shuffle}


def compression_kwargs(spec: str | None) -> dict[str, Any]:
    """h5py ``create_dataset`` keyword arguments for a spec (``{}`` for None or ``"none"``).

    Args:
        spec: None/``"none"``, ``"gzip"`` (level 4) or ``"gzip-<level>"``, ``"lzf"``, ``"zstd"``
            (level 1) or ``"zstd-<level>"``, ``"lz4"``, ``"blosc2"`` (:data:`BLOSC2_DEFAULT`) or
            ``"blosc2-<codec>[-<level>][-<shuffle>]"``; any of them followed by ``"+checksum"``
            adds HDF5's fletcher32 filter (a checksum per chunk, checked by HDF5 on every read).

    Raises:
        InvalidArgumentError: an unknown name or level.
        ImportError: zstd, lz4 or blosc2 without hdf5plugin installed.
    """
    _, info = parse_spec(spec)
    name = info["name"]
    kw: dict[str, Any] = {}
    if name == "gzip":
        kw = {"compression": "gzip", "compression_opts": info["level"], "shuffle": False}
    elif name == "lzf":
        kw = {"compression": "lzf"}
    elif name in ("zstd", "lz4", "blosc2"):
        import hdf5plugin

        if name == "zstd":
            kw = dict(hdf5plugin.Zstd(clevel=info["level"]))
        elif name == "lz4":
            kw = dict(hdf5plugin.LZ4())
        else:
            _default_blosc_threads()
            kw = dict(hdf5plugin.Blosc2(cname=info["cname"], clevel=info["level"],
                                        filters=_BLOSC2_SHUFFLES[info["shuffle"]]))
    if info["checksum"]:
        # (HDF5 runs fletcher32 after the compressor: the checksum covers the stored bytes)
        kw["fletcher32"] = True
    return kw


def _default_blosc_threads() -> None:
    """Blosc2 compresses a chunk's blocks on ``BLOSC_NTHREADS`` threads (read by the filter at
    every call); unless the user set it, the writer uses up to 4 (at most the cores there are)."""
    if "BLOSC_NTHREADS" not in os.environ:
        os.environ["BLOSC_NTHREADS"] = str(max(1, min(4, os.cpu_count() or 1)))


def spec_of_dataset(ds: Any) -> str | None:
    """The spec that writes a dataset like ``ds`` (an h5py dataset): a merge keeps a field's
    compression, its level and its checksums. Filters hookline does not write give None."""
    dcpl = ds.id.get_create_plist()
    return spec_of_filters([dcpl.get_filter(i)[:3] for i in range(dcpl.get_nfilters())])


def spec_of_filters(filters: Iterable[tuple[int, int, tuple[int, ...]]]) -> str | None:
    """:func:`spec_of_dataset` from a dataset's filter pipeline: ``(filter id, flags, client
    values)`` per filter, as ``h5py``'s ``PropDCID.get_filter`` gives them."""
    codec, checksum = "none", False
    for fid, _, vals in filters:
        if fid == _FLETCHER32_ID:
            checksum = True
        elif fid == _GZIP_ID:
            codec = f"gzip-{vals[0]}" if vals and vals[0] in _LEVELS["gzip"] else "gzip"
        elif fid in _PLAIN_IDS:
            codec = _PLAIN_IDS[fid]
        elif fid == _ZSTD_ID:
            codec = f"zstd-{vals[0]}" if vals and vals[0] in _LEVELS["zstd"] else "zstd"
        elif fid == _BLOSC2_ID:
            # (hdf5-blosc2's client values: [.., .., typesize, chunk bytes, clevel, shuffle, codec, ...])
            ok = len(vals) >= 7 and vals[6] in _BLOSC2_CODE_NAMES and vals[5] in (0, 1, 2) and vals[4] in _BLOSC2_LEVELS
            codec = (f"blosc2-{_BLOSC2_CODE_NAMES[vals[6]]}-{vals[4]}-{_SHUFFLE_WORDS[vals[5]]}" if ok
                     else BLOSC2_DEFAULT)
    spec = codec + (CHECKSUM_SUFFIX if checksum else "")
    return None if spec == "none" else spec


_GZIP_ID, _FLETCHER32_ID, _ZSTD_ID, _BLOSC2_ID = 1, 3, 32015, 32026
_PLAIN_IDS = {32000: "lzf", 32004: "lz4"}
_BLOSC2_CODE_NAMES = {0: "blosclz", 1: "lz4", 2: "lz4hc", 4: "zlib", 5: "zstd"}
_SHUFFLE_WORDS = {v: k for k, v in _BLOSC2_SHUFFLES.items()}


class CompressionRules:
    """A writer's ``compression`` argument, checked: one spec for every field, or a mapping from
    field-name glob pattern to spec (first match wins; no match: uncompressed).

    Args:
        compression: ``None``, a spec (see :func:`compression_kwargs`) or a mapping of patterns
            to specs.

    Raises:
        HookTypeError: a spec that is not a str or None.
        InvalidArgumentError: an unknown spec (ImportError: zstd/lz4/blosc2 without hdf5plugin).
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
    """Import hdf5plugin (it registers the Zstd/LZ4/Blosc2 filters) when a dataset's ``filters``
    include one HDF5 lacks built in; a no-op when hdf5plugin is not installed (reading then fails
    in HDF5, naming the filter)."""
    if all(k in _BUILTIN_FILTERS for k in filters):
        return
    try:
        import hdf5plugin  # noqa: F401
    except ImportError:
        pass
