"""Counts in English: ``plural(1, "field")`` is ``"1 field"``, ``plural(2, "field")`` ``"2 fields"``.

The one rule for every count hookline prints (the CLI's messages and tables, ``VerifyReport``'s
text), so no message says "1 fields" or "file(s)".
"""

from __future__ import annotations

__all__ = ["plural"]

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
