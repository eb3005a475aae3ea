"""Pick modules of a model by qualified name and type (looking through DDP wrappers)."""

from __future__ import annotations

import difflib
import threading
from collections import deque
from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn

from hookline.storage.errors import HookTypeError

__all__ = ["EmptySelection", "empty_selections", "select"]

_WRAPPERS = (nn.parallel.DistributedDataParallel, nn.DataParallel)


@dataclass(frozen=True)
class EmptySelection:
    """A :func:`select` call that matched no module (kept so that a recorder that ends up
    recording nothing can name the likely cause).

    Attributes:
        pattern: the glob pattern.
        types: the ``types`` narrowing, as text (None when not given).
        model: the model's class name.
        nearby: module names of the model close to the pattern (else its first ones).
    """

    pattern: str
    types: str | None
    model: str
    nearby: tuple[str, ...]

    def __str__(self) -> str:
        narrowed = f", types={self.types}" if self.types else ""
        return (f"select({self.model}, {self.pattern!r}{narrowed}) matched no module; modules nearby: "
                f"{', '.join(map(repr, self.nearby)) or '(the model has no submodules)'}")


#: The latest selections that matched nothing, newest last (a few: only to explain an empty run).
_EMPTY: deque[EmptySelection] = deque(maxlen=4)
_EMPTY_LOCK = threading.Lock()


def empty_selections() -> list[EmptySelection]:
    """The latest :func:`select` calls of this process that matched no module, newest last."""
    with _EMPTY_LOCK:
        return list(_EMPTY)


def _note_empty(model: nn.Module, pattern: str, types: type | tuple[type, ...] | None, names: list[str]) -> None:
    named = [n for n in names if n]
    nearby = difflib.get_close_matches(pattern, named, n=5, cutoff=0.4) or named[:5]
    if types is not None:
        kinds = types if isinstance(types, tuple) else (types,)
        shown = ", ".join(t.__name__ for t in kinds)
    else:
        shown = None
    with _EMPTY_LOCK:
        _EMPTY.append(EmptySelection(pattern, shown, type(model).__name__, tuple(nearby)))


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
        pattern can be applied to models that lack some parts; a Recorder that then records
        nothing in a sampled step warns, naming the selection: :func:`empty_selections`).

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
    inner = _unwrap(model)
    named = list(inner.named_modules())
    found = {name: module for name, module in named
             if fnmatchcase(name, pattern) and (types is None or isinstance(module, types))}
    if not found:
        _note_empty(inner, pattern, types, [name for name, _ in named])
    return found


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DistributedDataParallel / DataParallel wrapper."""
    while isinstance(model, _WRAPPERS):
        model = model.module
    return model
