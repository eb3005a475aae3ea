"""Counts and sizes in English: ``plural(2, "field")`` is ``"2 fields"``, ``human_bytes(1536)`` ``"1.5 KiB"``.

The one rule for every count and every size hookline prints (the CLI's messages and tables,
``VerifyReport``'s text, the Recorder's summary), so no message says "1 fields" or "file(s)", and
the same bytes read the same everywhere: binary units (KiB, MiB, GiB, TiB: powers of 1024), named
as such, as ``max_buffer_mb`` and the other ``*_mb`` options count MiB.
"""

from __future__ import annotations

__all__ = ["human_bytes", "plural"]

#: Nouns whose plural is not ``<noun>s``.
_IRREGULAR = {"loss": "losses", "entry": "entries", "was": "were", "match": "matches"}


def plural(n: int, noun: str, plural_form: str | None = None) -> str:
    """``"<n> <noun>"``, the noun in the plural unless ``n`` is 1.

    Args:
        n: the count.
        noun: the singular noun, e.g. ``"field"``.
        plural_form: its plural when it is not ``noun + "s"`` and not a known irregular one.

    Example:
        >>> plural(1, "field"), plural(3, "record"), plural(2, "loss")
        ('1 field', '3 records', '2 losses')
    """
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {plural_form or _IRREGULAR.get(noun) or noun + 's'}"


#: Units of :func:`human_bytes`, each 1024 times the one before.
_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int | float | None) -> str:
    """A size in binary units, as every size hookline prints reads: ``"512 B"``, ``"1.5 KiB"``,
    ``"180.2 MiB"`` (1 MiB = 2**20 bytes; the ``*_mb`` options count MiB too).

    Args:
        n: bytes; ``None`` when unknown.

    Returns:
        Bytes below 1 KiB as a whole number of ``B``, larger sizes with one decimal in the largest
        unit that keeps the number under 1024 (``PiB`` at most); ``"?"`` for ``None``.

    Example:
        >>> human_bytes(512), human_bytes(1536), human_bytes(188_700_000), human_bytes(None)
        ('512 B', '1.5 KiB', '180.0 MiB', '?')
    """
    if n is None:
        return "?"
    x = float(n)
    for unit in _BYTE_UNITS[:-1]:
        digits = 0 if unit == "B" else 1
        if abs(round(x, digits)) < 1024:  # (as printed: 1023.96 KiB reads 1.0 MiB, not 1024.0 KiB)
            return f"{x:.{digits}f} {unit}"
        x /= 1024
    return f"{x:.1f} {_BYTE_UNITS[-1]}"
