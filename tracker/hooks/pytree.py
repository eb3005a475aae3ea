"""Flatten module arguments and outputs to tensor leaves, and put replacements back.

Hooks see a module call's inputs and outputs as a flat :class:`Leaves` tuple of tensors, whatever
the real structure (a bare tensor, ``(out, (h, c))``, a dict, a namedtuple, a dataclass, keyword
arguments...). Order is stable: depth-first in container order (tuple/list index, dict insertion
order, namedtuple/dataclass field order); for a call, the positional arguments come first, then
the keyword arguments in call order. Every leaf has a path (``"0"``, ``"1.0"``,
``"attention_mask"``); leaves that are not tensors (``None``, ints, strings, other objects) are
left out of the tuple and listed in :attr:`Leaves.skipped`.

:func:`unflatten` rebuilds the original structure with new tensors in place of the old ones
(non-tensor leaves are kept as they were). Flattening runs on every hooked module call, so the
common shapes (a bare tensor, a flat tuple of tensors) take a fast path.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["Leaves", "flatten", "flatten_call", "index_paths", "unflatten", "unflatten_call"]

_Tensor = torch.Tensor


class Leaves(tuple):
    """A tuple of tensor leaves (or ``None`` gradients) with their pytree paths.

    Attributes:
        paths: one path per leaf, e.g. ``("0", "1.0", "1.1")`` for an LSTM's ``(out, (h, c))``.
        skipped: paths of non-tensor leaves that were left out (``None``, ints, strings...).
    """

    paths: tuple[str, ...]
    skipped: tuple[str, ...]

    def __new__(cls, items: Sequence[Any], paths: Sequence[str], skipped: Sequence[str] = ()) -> Leaves:
        self = tuple.__new__(cls, items)
        self.paths = paths if type(paths) is tuple else tuple(paths)
        self.skipped = skipped if type(skipped) is tuple else tuple(skipped)
        return self

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # copy, deepcopy, pickle and torch.save/load (e.g. of hook arguments a user stored)
        return Leaves, (tuple(self), self.paths, self.skipped)

    def __repr__(self) -> str:
        return f"Leaves({tuple.__repr__(self)}, paths={self.paths!r})"


# A spec describes how to rebuild a structure from its leaves. It is one of:
#   _LEAF                        a tensor leaf
#   _Tuple(n)                    a plain tuple of n tensors (the fast path)
#   (_CONST, value)              a non-tensor leaf, kept as is
#   (kind, type, keys, children) a container; kind in _SEQ, _DICT, _NAMEDTUPLE, _DATACLASS
_LEAF = "leaf"
_CONST = "const"
_SEQ = "seq"
_DICT = "dict"
_NAMEDTUPLE = "namedtuple"
_DATACLASS = "dataclass"


class _Tuple(int):
    """Spec of a plain tuple of tensors (an int subclass: its value is the length)."""


_INDEX_PATHS: list[tuple[str, ...]] = [tuple(str(i) for i in range(n)) for n in range(17)]


_ONE_PATH = _INDEX_PATHS[1]


def index_paths(n: int) -> tuple[str, ...]:
    """The paths ``("0", "1", ..., str(n - 1))`` of ``n`` indexed leaves (cached for small n)."""
    return _INDEX_PATHS[n] if n < len(_INDEX_PATHS) else tuple(str(i) for i in range(n))


def _walk(obj: Any, path: str, leaves: list, paths: list, skipped: list) -> Any:
    """Append the tensor leaves of ``obj`` (depth first) and return its spec."""
    if isinstance(obj, _Tensor):
        leaves.append(obj)
        paths.append(path)
        return _LEAF
    prefix = f"{path}." if path else ""
    if isinstance(obj, (tuple, list)):
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
            keys = obj._fields
            children = [_walk(v, prefix + k, leaves, paths, skipped) for k, v in zip(keys, obj)]
            return (_NAMEDTUPLE, type(obj), keys, children)
        children = [_walk(v, f"{prefix}{i}", leaves, paths, skipped) for i, v in enumerate(obj)]
        return (_SEQ, type(obj), None, children)
    if isinstance(obj, dict):
        keys = tuple(obj)
        children = [_walk(obj[k], f"{prefix}{k}", leaves, paths, skipped) for k in keys]
        return (_DICT, obj, keys, children)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        keys = tuple(f.name for f in dataclasses.fields(obj))
        children = [_walk(getattr(obj, k), prefix + k, leaves, paths, skipped) for k in keys]
        return (_DATACLASS, obj, keys, children)
    skipped.append(path)
    return (_CONST, obj)


def flatten(obj: Any) -> tuple[Leaves, Any]:
    """Flatten a module output (or any structure) to its tensor leaves.

    A bare tensor is one leaf with path ``"0"``; the elements of a top-level tuple or list are
    ``"0"``, ``"1"``...; dict, namedtuple and dataclass fields are named by their key.

    Returns:
        ``(leaves, spec)``; pass ``spec`` and replacement leaves to :func:`unflatten`.

    Example:
        >>> leaves, spec = flatten({"logits": t, "loss": None})
        >>> leaves.paths, leaves.skipped
        (('logits',), ('loss',))
    """
    if isinstance(obj, _Tensor):
        return Leaves((obj,), ("0",)), _LEAF
    if type(obj) is tuple and all(type(t) is _Tensor for t in obj):
        return Leaves(obj, index_paths(len(obj))), _Tuple(len(obj))
    leaves: list = []
    paths: list = []
    skipped: list = []
    if isinstance(obj, (tuple, list, dict)) or (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        spec: Any = _walk(obj, "", leaves, paths, skipped)
    else:  # a lone non-tensor output (None...)
        skipped.append("0")
        spec = (_CONST, obj)
    return Leaves(leaves, paths, skipped), spec


def _build(spec: Any, it: Any) -> Any:
    if spec is _LEAF:
        return next(it)
    if type(spec) is _Tuple:
        return tuple(next(it) for _ in range(spec))
    kind = spec[0]
    if kind is _CONST:
        return spec[1]
    _, ref, keys, children = spec
    values = [_build(c, it) for c in children]
    if kind is _SEQ:
        return ref(values)
    if kind is _NAMEDTUPLE:
        return ref(*values)
    new = copy.copy(ref)
    if kind is _DICT:
        for k, v in zip(keys, values):
            new[k] = v
    else:
        for k, v in zip(keys, values):
            object.__setattr__(new, k, v)
    return new


def unflatten(spec: Any, leaves: Sequence[Any]) -> Any:
    """Rebuild the structure described by ``spec`` with ``leaves`` in place of its tensors.

    Containers are rebuilt with their own type (dict subclasses and dataclasses are shallow
    copies with the fields replaced); non-tensor leaves are kept as they were.
    """
    if spec is _LEAF:
        return leaves[0]
    return _build(spec, iter(leaves))


def flatten_call(args: tuple, kwargs: dict) -> tuple[Leaves, Any]:
    """Flatten a module call's arguments: positional leaves first, then keyword leaves.

    Positional arguments have paths ``"0"``, ``"1"``...; keyword arguments their name
    (``"attention_mask"``); nested containers append ``.key``.

    Returns:
        ``(leaves, spec)``; pass ``spec`` and replacement leaves to :func:`unflatten_call`.
    """
    if not kwargs:
        # One plain tensor (most module calls) without building a generator; then any tuple
        # of plain tensors.
        if len(args) == 1 and type(args[0]) is _Tensor:
            return Leaves(args, _ONE_PATH), None
        if all(type(t) is _Tensor for t in args):
            return Leaves(args, index_paths(len(args))), None
    leaves: list = []
    paths: list = []
    skipped: list = []
    arg_specs = [_walk(v, str(i), leaves, paths, skipped) for i, v in enumerate(args)]
    kw_specs = [(k, _walk(v, k, leaves, paths, skipped)) for k, v in kwargs.items()]
    return Leaves(leaves, paths, skipped), (arg_specs, kw_specs)


def unflatten_call(spec: Any, leaves: Sequence[Any]) -> tuple[tuple, dict]:
    """Rebuild ``(args, kwargs)`` from a :func:`flatten_call` spec and replacement leaves."""
    if spec is None:
        return tuple(leaves), {}
    it = iter(leaves)
    arg_specs, kw_specs = spec
    args = tuple(_build(s, it) for s in arg_specs)
    kwargs = {k: _build(s, it) for k, s in kw_specs}
    return args, kwargs
