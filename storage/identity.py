"""Whether a handle file is the run's own, and whether a failure to read it is damage.

A complete file is read as a handle's records (reader), passes ``verify`` or is uploaded
(``sync``) only when it proves it belongs there (docs/format.md, "Identity"):

* its ``handle_id`` attribute is the handle's id (valid UTF-8: a name that does not decode is
  damage, never a handle of its own);
* its ``run_uuid`` attribute, when the file and the manifest both have one, is the manifest's
  (runs written before ``run_uuid`` existed carry none and are not checked);
* a closed run's handle has every field its manifest entry lists in one of its files.

A file that cannot be opened for a reason that says nothing about its bytes (permission denied,
a read-only file system, a lock held elsewhere) is *inaccessible*, not damaged: it is reported
and left where it is, never moved to the quarantine or recorded as lost.
"""

from __future__ import annotations

import errno
from typing import Any, Iterable, Mapping

__all__ = ["ACCESS_ERRNOS", "access_problem", "foreign", "is_utf8", "missing_fields", "ACCESS_HINT"]

#: errnos that say the file could not be reached, not that its bytes are wrong.
ACCESS_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.EAGAIN, errno.EBUSY, errno.ETXTBSY}

#: What to do about an inaccessible file (said after the cause).
ACCESS_HINT = ("not damage: nothing was moved or recorded as lost; give this user read access (and write "
               "access for --repair), then verify again")


def is_utf8(text: str) -> bool:
    """Whether ``text`` came from valid UTF-8 (undecodable bytes come back as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def access_problem(e: BaseException | None) -> str | None:
    """``"permission denied"`` (the ``strerror``) when ``e`` or one of its causes is an access
    failure (:data:`ACCESS_ERRNOS`; h5py puts the errno in its message), else None."""
    seen = 0
    while e is not None and seen < 8:
        code = getattr(e, "errno", None)
        if code in ACCESS_ERRNOS:
            return (getattr(e, "strerror", None) or errno.errorcode[code]).lower()
        text = str(e)
        for c in ACCESS_ERRNOS:
            if f"errno = {c}," in text:
                return errno.errorcode[c].lower() if c != errno.EACCES else "permission denied"
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def foreign(attrs: Mapping[str, Any], handle_id: str, run_uuid: Any) -> str | None:
    """Why a file with root attributes ``attrs`` is not a file of handle ``handle_id`` of the run
    whose manifest has ``run_uuid``, or None when it is (see the module docstring)."""
    hid = attrs.get("handle_id")
    if isinstance(hid, str) and hid != handle_id:
        return f"it holds handle {hid!r}, not {handle_id!r}"
    theirs = attrs.get("run_uuid")
    if isinstance(theirs, str) and theirs and isinstance(run_uuid, str) and run_uuid and theirs != run_uuid:
        return (f"it belongs to another run (its run_uuid is {theirs!r:.40}, this run's manifest says "
                f"{run_uuid!r:.40}): a file copied in from another run is never read as this run's")
    return None


def missing_fields(manifest: Mapping[str, Any], entry: Mapping[str, Any], present: Iterable[str]) -> list[str]:
    """The fields a closed run's manifest entry lists that none of the handle's files hold
    (empty for a run that is not closed: its manifest may list fields of records never sealed)."""
    if manifest.get("status") != "closed":
        return []
    listed = entry.get("fields")
    if not isinstance(listed, dict):
        return []
    have = set(present)
    return sorted(nm for nm in listed if nm not in have)
