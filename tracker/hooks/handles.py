"""Hook registrations: HookFunction (a registered function), HookHandle (one function on one
module, switched on and off through its module's slot) and the passive mark."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

from torch import nn

from hookline.storage.errors import HookFunctionError, HookTypeError, InvalidArgumentError

__all__ = ["HandleSlot", "HookFunction", "HookHandle", "passive"]

_PASSIVE = "_hookline_passive"


def passive(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a forward hook function as passive: it only reads what it is handed.

    A passive hook may copy, summarise or log its inputs and outputs (detached, or under
    ``torch.no_grad()``), but never modifies them in place, returns a replacement, or uses them
    in a computation that autograd records. Backward hooks of the same manager on the module
    can then read ``grad_in`` off single-op modules' own graph nodes instead of an identity node
    (docs/hooks.md, "single-op calls"). Unmarked forward hooks are assumed to compute with their
    inputs. The recorder's hooks are passive. Mark a function before registering it.

    Returns ``fn`` itself (marked), so it works as a decorator; a bound method marks its
    function, for every instance. The mark names the object it was put on: a wrapper made with
    ``functools.wraps`` (which copies attributes) is not passive unless marked itself.

    Raises:
        HookTypeError: ``fn`` is not callable, is a registration (:class:`HookFunction`) rather
            than the function, or cannot carry the mark (a builtin).
    """
    if not callable(fn):
        raise HookTypeError(f"passive() takes a hook function, got {type(fn).__name__} {fn!r:.60}")
    if isinstance(fn, HookFunction):
        raise HookTypeError(
            f"passive() takes the hook function itself, not its registration {fn!r:.80}; mark the "
            "function before registering it: mgr.register_forward_hook(passive(fn), ...)"
        )
    target = getattr(fn, "__func__", fn)  # bound methods forward attribute reads to __func__
    try:
        setattr(target, _PASSIVE, weakref.ref(target))
    except (AttributeError, TypeError):
        raise HookTypeError(
            f"passive() cannot mark {fn!r:.60} ({type(fn).__name__}); wrap it in a function: "
            "passive(lambda m, i, o: fn(m, i, o))"
        ) from None
    return fn


def is_passive(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` was marked with :func:`passive` (as the recorder's hooks are)."""
    mark = getattr(fn, _PASSIVE, None)
    # put on this very object (not copied by functools.wraps)
    return isinstance(mark, weakref.ref) and mark() is getattr(fn, "__func__", fn)


class HookFunction:
    """A hook function registered with a :class:`~hookline.tracker.HookManager`.

    Attributes:
        fn: the user's callable.
        name: its id in ``HookManager.name_to_hookfn`` (``repr(fn)`` unless given).
        category: ``"forward_hook"``, ``"forward_pre_hook"`` or ``"backward_hook"``.
        module_to_handle: ``{module: HookHandle}`` for every module it is registered on.
    """

    def __init__(self, fn: Callable[..., Any], name: str, category: str) -> None:
        self.fn = fn
        self.name = name
        self.category = category
        self.module_to_handle: dict[nn.Module, HookHandle] = {}

    def __call__(self, *args: Any) -> Any:
        """Call the wrapped function directly (no error wrapping, no replacement logic)."""
        return self.fn(*args)

    def __repr__(self) -> str:
        return f"HookFunction({self.name!r}, {self.category}, {len(self.module_to_handle)} modules)"


class HandleSlot(Protocol):
    """Where a handle switches itself on and off: the dispatcher of its module
    (:class:`~hookline.tracker.hooks.dispatch.ModuleHooks`)."""

    def add(self, handle: HookHandle) -> None:
        """Start calling ``handle`` on the module's calls."""

    def discard(self, handle: HookHandle) -> None:
        """Stop calling ``handle``."""


class HookHandle:
    """One registration of a :class:`HookFunction` on one module.

    Usable as a context manager that removes the hook on exit, like torch's ``RemovableHandle``::

        with mgr.register_forward_hook(fn, m=model).module_to_handle[model]:
            model(x)

    Attributes:
        hook_fn: the :class:`HookFunction`.
        module: the hooked module.
        module_name: the module's name in the manager.
        name: the handle id, ``"<hook_fn.name>[<module_name>]"``.
        order: registration sequence number (hooks on one module fire in this order).
    """

    def __init__(
        self, hook_fn: HookFunction, module: nn.Module, module_name: str, slot: HandleSlot,
        order: int, on_remove: Callable[[HookHandle], None],
    ) -> None:
        """Made by the manager: ``slot`` serves the module, ``on_remove`` purges the handle from
        the manager's tables (called once, by :meth:`remove`)."""
        self.hook_fn = hook_fn
        self.module = module
        self.module_name = module_name
        self.name = f"{hook_fn.name}[{module_name}]"
        self.order = order
        self._on_remove: Callable[[HookHandle], None] | None = on_remove
        self._slot = slot
        self._active = False
        self._suspended = False

    @property
    def active(self) -> bool:
        """Whether the hook is switched on (by :meth:`activate` or the manager's contexts).

        An active handle runs when the module is called unless it is :attr:`suspended`.
        """
        return self._active

    @property
    def suspended(self) -> bool:
        """Whether the hook's owner (a :class:`~hookline.tracker.Recorder` on a step it does
        not sample, or inside ``paused()``) holds it off. Independent of :attr:`active`: what
        the user switched off stays off when the suspension ends, and vice versa."""
        return self._suspended

    @property
    def runs(self) -> bool:
        """Whether the hook runs on the module's next calls (active and not suspended)."""
        return self._active and not self._suspended

    @property
    def removed(self) -> bool:
        """Whether the handle was removed (it can then never be activated again)."""
        return self._on_remove is None

    def activate(self) -> None:
        """Make the hook run on the module's next calls (no-op when already active).

        Raises:
            InvalidArgumentError: the handle was removed.
        """
        if self._on_remove is None:
            raise InvalidArgumentError(
                f"hook handle {self.name!r} was removed and cannot be activated again; "
                "register the hook function on the module again"
            )
        if not self._active:
            self._active = True
            if not self._suspended:
                self._slot.add(self)

    def deactivate(self) -> None:
        """Stop running the hook; no-op when inactive or removed."""
        if self._active:
            self._active = False
            if not self._suspended:
                self._slot.discard(self)

    def set_suspended(self, suspended: bool) -> None:
        """Hold the hook off (or release it) for its owner, leaving :attr:`active` alone (see
        :attr:`suspended`); no-op on a removed handle."""
        if suspended != self._suspended and self._on_remove is not None:
            self._suspended = suspended
            if self._active:
                if suspended:
                    self._slot.discard(self)
                else:
                    self._slot.add(self)

    def remove(self) -> None:
        """Deactivate the hook and purge it from its manager's tables. Idempotent."""
        on_remove, self._on_remove = self._on_remove, None
        if on_remove is not None:
            self.deactivate()
            on_remove(self)

    def call(self, *args: Any) -> Any:
        """Call the hook function; re-raise its exception as HookFunctionError naming the handle.

        Raises:
            HookFunctionError: the hook raised; ``__cause__`` is the original exception.
        """
        try:
            return self.hook_fn.fn(*args)
        except Exception as e:
            raise HookFunctionError(
                f"hook {self.name!r} raised {type(e).__name__}: {e} "
                "(the original exception is chained as __cause__)"
            ) from e

    def __enter__(self) -> HookHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self.removed else "active" if self._active else "inactive"
        if self._suspended and not self.removed:
            state += ", suspended"
        return f"<HookHandle {self.name!r} ({self.hook_fn.category}, {state})>"
