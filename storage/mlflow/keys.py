"""MLflow names of a run directory's contents: tag keys, metric keys, artifact paths.

Scheme (see docs/mlflow.md): with ``K = handle_key(handle_id)`` (plus ``-rank<r>`` when ranked) a
handle's tags are ``hookline.K/<name>`` and its metrics ``hookline.K/<field>.norm`` and
``.norm_max``. ``K`` holds at most one ``/`` and field names are escaped like
handle keys (no ``/``), so the last ``/`` always separates the handle from the name; run-level
tags (``hookline.version``, ``hookline.has.<ModuleType>``...) contain no ``/`` at all.
"""

from __future__ import annotations

import hashlib

from ..errors import InvalidArgumentError
from ..keys import escape_part, handle_key

__all__ = [
    "ARTIFACT_ROOT",
    "MAX_MLFLOW_KEY",
    "MAX_TAG_VALUE",
    "VERSION_TAG",
    "FORMAT_VERSION_TAG",
    "tag_key",
    "metric_key",
    "handles_tag",
    "origin_tag",
    "module_type_tag",
    "bytes_tag",
    "cut_tag_value",
]

#: MLflow's limit on tag/metric key length.
MAX_MLFLOW_KEY = 250
#: MLflow's limit on tag value length (longer values are cut, with a marker).
MAX_TAG_VALUE = 8000
#: Artifact folder that holds a run directory inside the MLflow run.
ARTIFACT_ROOT = "hookline"
#: Run tag that every run holding hookline data carries (its value: the hookline version).
VERSION_TAG = "hookline.version"
#: Run tag: the format versions of the synced manifests, comma-separated.
FORMAT_VERSION_TAG = "hookline.format_version"


def _fit(prefix: str, body: str, tail: str = "") -> str:
    """``prefix + body + tail`` cut to MLflow's 250 characters by hashing the end of ``body``."""
    key = prefix + body + tail
    if len(key) <= MAX_MLFLOW_KEY:
        return key
    budget = MAX_MLFLOW_KEY - len(prefix) - len(tail) - 18
    if budget < 0:  # cannot happen with handle_key's MAX_KEY_LEN, but never emit a bad key
        raise InvalidArgumentError(f"MLflow key prefix {prefix!r} is too long; use a shorter handle id")
    head = body[:budget]
    if head[-2:].startswith("-"):
        head = head[:-2]
    elif head.endswith("-"):
        head = head[:-1]
    digest = hashlib.sha1(body.encode("utf-8")).hexdigest()[:16]
    return f"{prefix}{head}-h{digest}{tail}"


def _rank_suffix(rank: object) -> str:
    return "" if rank is None else f"-rank{rank}"


def _handle_prefix(handle_id: str, rank: int | None) -> str:
    return f"hookline.{handle_key(handle_id)}" + _rank_suffix(None if rank is None else int(rank)) + "/"


def tag_key(handle_id: str, name: str, *, rank: int | None = None) -> str:
    """The MLflow tag key of one per-handle tag.

    Args:
        handle_id: the hook handle id, e.g. ``"outputs[blocks.0]"``.
        name: tag name: ``id`` or ``records`` (see :data:`~.runpage.HANDLE_TAGS`).
        rank: the distributed rank, if the run was recorded with one.

    Returns:
        e.g. ``"hookline.outputs/blocks.0/id"`` (``"hookline.outputs/blocks.0-rank1/id"``).
    """
    return _fit(_handle_prefix(handle_id, rank), escape_part(name))


def metric_key(handle_id: str, field_name: str, stat: str = "norm", *, rank: int | None = None) -> str:
    """The MLflow metric key of a field's norm series or summary.

    Args:
        handle_id: the hook handle id, e.g. ``"grads[blocks.0]"``.
        field_name: the field, e.g. ``"grad_out.0"``.
        stat: ``"norm"`` (per-record series) or ``"norm_max"`` (its running maximum).
        rank: the distributed rank, if the run was recorded with one.

    Returns:
        e.g. ``"hookline.grads/blocks.0/grad_out.0.norm_max"``. Keys longer than 250 characters
        keep their start and end and replace the middle of the field name by ``-h<sha1[:16]>``.
    """
    return _fit(_handle_prefix(handle_id, rank), escape_part(field_name), "." + stat)


def handles_tag(rank: int | None) -> str:
    """Run tag holding the number of handles synced (of one rank): ``hookline.handles[-rank<r>]``."""
    return "hookline.handles" + _rank_suffix(rank)


def origin_tag(rank: object) -> str:
    """Run param (earlier builds set a tag of that name, still honoured) naming the run
    directory synced into the run (of one rank, by its manifest's ``rank``):
    ``hookline.origin[-rank<r>]``."""
    return "hookline.origin" + _rank_suffix(rank)


def module_type_tag(module_type: str | None) -> str | None:
    """Run tag marking that a handle of this module type was synced (``hookline.has.Linear`` for
    ``torch.nn.modules.linear.Linear``), or None without a module type."""
    if not module_type:
        return None
    return "hookline.has." + escape_part(str(module_type).rsplit(".", 1)[-1])


def bytes_tag(rank: int | None) -> str:
    """Run tag holding the bytes of the handle files uploaded (of one uploader's rank):
    ``hookline.bytes[-rank<r>]``; set together with the sync record (:mod:`.syncstate`)."""
    return "hookline.bytes" + _rank_suffix(rank)


def cut_tag_value(value: str) -> str:
    """``value`` cut to MLflow's tag value limit, ending in ``...[truncated]`` when cut."""
    if len(value) <= MAX_TAG_VALUE:
        return value
    return value[: MAX_TAG_VALUE - 20] + "...[truncated]"
