"""What one capture firing yields: its tensors named as storage fields, sliced (and summarised).

Field names are ``<group>.<leaf path>`` (``outputs.0``, ``grad_in.1``, ``inputs.attention_mask``).
"""

from __future__ import annotations

import torch

from hookline.storage.errors import HookTypeError, InvalidArgumentError
from hookline.tracker.hooks.pytree import index_paths

from .dtensor import ShardLayout, is_dtensor, local_shard
from .hook import CaptureOptions, Groups
from .stats import StatsSpec, compute_stats

__all__ = ["field_tensors"]


def field_tensors(groups: Groups, options: CaptureOptions, layouts: dict[str, ShardLayout] | None = None,
                  ) -> tuple[list[str], list[torch.Tensor], list[str]]:
    """Name and slice the tensors of one firing (stats mode: cast and summarise them).

    A DTensor leaf is taken as its local shard and its layout goes into ``layouts`` (when given);
    a replicated one is left out on ranks that are not mesh coordinate 0 along its replicated
    dimensions (stored once: see :mod:`.dtensor`).

    Returns:
        ``(names, tensors, skipped)``: field names (``outputs.0``, ``grad_in.1``...), the detached
        tensors to copy (stats mode: one packed stats tensor per field; tensor mode: not yet cast,
        the copy into the host block casts), and the paths of non-tensor leaves and ``None``
        gradients that were not recorded.
    """
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    skipped: list[str] = []
    stats = options.mode == "stats"
    k = options.batch_slice
    for prefix, leaves in groups:
        paths = getattr(leaves, "paths", None) or index_paths(len(leaves))
        group_names = _names(prefix, paths)
        leaf_skipped = getattr(leaves, "skipped", ())
        if leaf_skipped:
            skipped.extend(f"{prefix}.{p}" for p in leaf_skipped)
        for name, t in zip(group_names, leaves):
            if t is None:
                skipped.append(name)
                continue
            if type(t) is not _TENSOR and is_dtensor(t):  # (plain tensors: one comparison)
                t, layout = local_shard(name, t, k)
                if layouts is not None:
                    layouts[name] = layout
                if not layout.stores:
                    continue  # replicated: mesh coordinate 0 stores it
            else:
                if t.layout is not _STRIDED or t.is_quantized or t.is_meta:
                    _refuse_layout(name, t)
                if k is not None and t.dim() > 0:
                    t = t[:k]
            t = t.detach()
            if stats:
                if options.dtype is not None and t.is_floating_point() and t.dtype != options.dtype:
                    t = t.to(options.dtype)  # stats of what a tensor capture would store
                t = compute_stats(t, options.stats or StatsSpec())
            names.append(name)
            tensors.append(t)
    return names, tensors, skipped


_STRIDED = torch.strided
_TENSOR = torch.Tensor


def _refuse_layout(name: str, t: torch.Tensor) -> None:
    what = "quantized" if t.is_quantized else "meta" if t.is_meta else str(t.layout).removeprefix("torch.")
    raise HookTypeError(
        f"field {name!r} is a {what} tensor, which hookline cannot record (dense strided tensors "
        f"only); convert it in the module (to_dense()/dequantize()) or do not hook this module"
    )


_NAME_CACHE: dict[tuple[str, tuple[str, ...]], tuple[str, ...]] = {}


def _names(prefix: str, paths: tuple[str, ...]) -> tuple[str, ...]:
    """Field names ``<prefix>.<path>`` (cached: a module's paths rarely change between calls)."""
    key = (prefix, paths)
    names = _NAME_CACHE.get(key)
    if names is None:
        names = tuple(f"{prefix}.{p}" for p in paths)
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise InvalidArgumentError(
                f"two tensors of the {prefix} would both be stored as field {dup!r} (paths "
                f"{[p for p in paths if f'{prefix}.{p}' == dup]}: a dict key containing '.' or a str "
                f"key equal to an int key); rename one of the keys in the module's output"
            )
        if len(_NAME_CACHE) < 4096:  # bounded: paths of dict outputs could vary without end
            _NAME_CACHE[key] = names
    return names
