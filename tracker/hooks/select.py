"""Pick modules of a model by qualified name and type (looking through DDP wrappers)."""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from hookline.storage.errors import HookTypeError

__all__ = ["select"]

_WRAPPERS = (nn.parallel.DistributedDataParallel, nn.DataParallel)


def select(
    model: nn.Module,
    pattern: str = "*",
    types: type | tuple[type, ...] | None = None,
) -> dict[str, nn.Module]:
    """Return the submodules of ``model`` whose qualified name matches a glob pattern.

    The result is ordered like ``model.named_modules()`` and can be passed straight to a
    registration call: ``mgr.register_forward_hook(fn, **select(model, "encoder.layers.*.mlp"))``.
    Names are the qualified names of ``named_modules()``; the root module's name is ``""``, so
    ``"*"`` includes it (a plain hook may record it; a Recorder's hook refuses the empty name: use
    ``"?*"`` to leave the root out, or register the root under a name). A module reachable under several names is
    listed once, under its first name. A ``DistributedDataParallel`` / ``DataParallel`` wrapper is
    looked through, so names carry no ``module.`` prefix and match those of a single-process run.

    Args:
        model: the root module (or a DDP/DataParallel wrapper of it).
        pattern: an ``fnmatch`` glob, case-sensitive (``*`` also matches dots:
            ``"blocks.*"`` selects ``blocks.0`` and ``blocks.0.mlp``; use ``"blocks.?"`` or
            ``types`` to narrow).
        types: keep only modules that are instances of this type (or tuple of types).

    Returns:
        ``{qualified_name: module}``; empty when nothing matches (not an error, so that a
        pattern can be applied to models that lack some parts).

    Raises:
        HookTypeError: ``model`` is not an ``nn.Module``, ``pattern`` is not a str, or
            ``types`` is not a type or a tuple of types.
    """
    if not isinstance(model, nn.Module):
        raise HookTypeError(f"select() needs an nn.Module, got {type(model).__name__} {model!r:.80}")
    if not isinstance(pattern, str):
        raise HookTypeError(f"select() pattern must be a glob str like 'blocks.*', got {pattern!r}")
    if types is not None and not (
        isinstance(types, type) or (isinstance(types, tuple) and all(isinstance(t, type) for t in types))
    ):
        raise HookTypeError(f"select() types must be a type or a tuple of types, got {types!r}")
    return {
        name: module
        for name, module in _unwrap(model).named_modules()
        if fnmatchcase(name, pattern) and (types is None or isinstance(module, types))
    }


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DistributedDataParallel / DataParallel wrapper."""
    while isinstance(model, _WRAPPERS):
        model = model.module
    return model
