"""HookManager: register, find, (de)activate and remove module hooks by name.

Registration, lookup tables and filters follow TackleBox (every example of its README runs
unchanged); the hooks themselves are served by one :class:`~hookline.tracker.hooks.dispatch.ModuleHooks`
per module, which installs torch hooks only while some handle of that module is active.
"""

from __future__ import annotations

import difflib
import itertools
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Union

from torch import nn

from hookline.storage.errors import (
    DuplicateNameError,
    HookTypeError,
    InvalidArgumentError,
    UnknownNameError,
)
from hookline.storage.keys import check_name
from hookline.tracker.hooks.dispatch import ModuleHooks
from hookline.tracker.hooks.handles import HookFunction, HookHandle

__all__ = ["CATEGORIES", "HookManager"]

#: Valid values of every ``category`` argument.
CATEGORIES = ("all", "forward_hook", "forward_pre_hook", "backward_hook")

#: What ``hook_types`` may contain: raw functions, HookFunctions, or hook function names.
HookType = Union[Callable[..., Any], HookFunction, str]
#: A ``hook_types`` argument: None (no filter), one HookType, or several.
HookTypes = Union[Iterable[HookType], HookType, None]


def _unknown(kind: str, name: object, known: Iterable[str]) -> UnknownNameError:
    known = list(known)
    close = difflib.get_close_matches(str(name), known, n=3)
    hint = f"did you mean {', '.join(map(repr, close))}? " if close else ""
    shown = ", ".join(map(repr, known[:10])) + (", ..." if len(known) > 10 else "")
    return UnknownNameError(f"unknown {kind} {name!r}; {hint}registered: [{shown}]")


def _check_category(category: str) -> None:
    if category not in CATEGORIES:
        raise InvalidArgumentError(
            f"unknown hook category {category!r}; use one of {', '.join(map(repr, CATEGORIES))}"
        )


def _check_stored_names(category: str, hook_fn_name: str, targets: list[tuple[str, nn.Module]]) -> None:
    """The names a recording hook (one with ``_hookline_bind``, e.g. a Recorder's) stores in its
    run follow storage's rule (:func:`hookline.storage.keys.check_name`: no control characters,
    bounded length); checked before any handle is created, so a refused name registers nothing."""
    check_name(hook_fn_name, "hook function name",
               fix="register it with another hook_fn_name= (a Recorder hook: rec.hook(kind, name=...))")
    for module_name, _ in targets:
        if not module_name:
            raise InvalidArgumentError(
                f"module name {module_name!r} is empty (the root module's qualified name): a run cannot name its "
                f"handle; register it under a name, e.g. mgr.register_{category}(fn, model=model), or leave the root "
                f"out of a selection: select(model, '?*')")
        check_name(module_name, "module name",
                   fix=f"register the module under another name, e.g. mgr.register_{category}(fn, "
                       f"**{{{_clean_name(module_name)!r}: module}})")
        check_name(f"{hook_fn_name}[{module_name}]", "handle id", fix="use shorter module and hook function names")


def _clean_name(name: str) -> str:
    """``name`` without its unprintable characters (a suggestion for error messages)."""
    return "".join(ch for ch in name if ch.isprintable())[:60] or "my_module"


def _short(module: nn.Module) -> str:
    text = repr(module).replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."



#: Modules whose ``name`` attribute hookline set, with the (manager id, name) of every manager
#: that has hooks on them, in registration order. The module shows the first manager's name;
#: when that manager lets go of it, the next one's (TackleBox hooks read ``module.name``).
_NAME_USERS: weakref.WeakKeyDictionary[nn.Module, list[tuple[int, str]]] = weakref.WeakKeyDictionary()


def _release_name(module: nn.Module, manager: int) -> None:
    users = _NAME_USERS.get(module)
    if users is None:
        return
    shown = users[0][1]
    users[:] = [u for u in users if u[0] != manager]
    if module.__dict__.get("name") != shown:
        if not users:
            del _NAME_USERS[module]
        return  # the user renamed the module since: theirs to keep
    if users:
        module.name = users[0][1]
    else:
        del _NAME_USERS[module]
        del module.name


class HookManager:
    """Registers hook functions on modules and activates, deactivates and removes them by name.

    Attributes:
        name_to_module: ``{module_name: module}`` for every module with a registered hook.
        name_to_hookfn: ``{hook_fn_name: HookFunction}``.
        name_to_hookhandle: ``{"hook_fn_name[module_name]": HookHandle}``.
        module_to_name: ``{module: module_name}`` (the reverse of ``name_to_module``).

    Example:
        >>> mgr = HookManager()
        >>> mgr.register_forward_hook(fn, **select(model, "blocks.*"))
        >>> with mgr.hook_all_context(category="forward_hook"):
        ...     model(x)
    """

    def __init__(self) -> None:
        self.name_to_module: dict[str, nn.Module] = {}
        self.name_to_hookfn: dict[str, HookFunction] = {}
        self.name_to_hookhandle: dict[str, HookHandle] = {}
        self.module_to_name: dict[nn.Module, str] = {}
        self._slots: dict[nn.Module, ModuleHooks] = {}
        self._order = itertools.count()

    def __repr__(self) -> str:
        active = sum(h.active for h in self.name_to_hookhandle.values())
        return (f"<HookManager: {len(self.name_to_hookhandle)} handles ({active} active) on "
                f"{len(self.name_to_module)} modules>")

    # --- registration ----------------------------------------------------------------------
    def register_forward_hook(
        self, fn: Callable[..., Any], /, *modules: nn.Module, hook_fn_name: str | None = None,
        activate: bool = True, **named_modules: nn.Module,
    ) -> HookFunction:
        """Register ``fn(module, inputs, outputs)`` to run after each forward of the modules.

        ``inputs`` and ``outputs`` are :class:`~hookline.tracker.Leaves` (tuples of tensor
        leaves). Returning a tuple of the same length as ``outputs`` (or a bare tensor when
        there is one) replaces the outputs; ``None`` keeps them.

        Args:
            fn: the hook function (or a :class:`HookFunction` to register on more modules).
            *modules: modules to hook; each gets the name the manager already uses for it, or
                ``f"{type(module).__name__}_{n}"`` with the smallest free ``n``.
            hook_fn_name: id of the hook function; default ``repr(fn)``.
            activate: activate the new handles now (default) or leave them inactive.
            **named_modules: modules to hook, keyed by the name to register them under (names
                ``hook_fn_name`` and ``activate`` are taken by the arguments above; pass such
                modules positionally or give them another name).

        Returns:
            The :class:`HookFunction` (``.module_to_handle`` maps modules to new handles).

        Raises:
            HookTypeError: ``fn`` is not callable or a target is not an ``nn.Module``.
            DuplicateNameError: a name already denotes another module or hook function, a
                module is already registered under another name, or ``fn`` is already
                registered on one of the modules.
            InvalidArgumentError: ``fn`` records into a run (a Recorder's hook) and a module
                name or its hook function name contains a control character or is longer than
                1000 characters (names a run stores: :func:`hookline.storage.keys.check_name`).
        """
        return self._register("forward_hook", fn, modules, hook_fn_name, activate, named_modules)

    def register_forward_pre_hook(
        self, fn: Callable[..., Any], /, *modules: nn.Module, hook_fn_name: str | None = None,
        activate: bool = True, **named_modules: nn.Module,
    ) -> HookFunction:
        """Register ``fn(module, inputs)`` to run before each forward of the modules.

        Returning a tuple of the same length as ``inputs`` (or a bare tensor when there is one)
        replaces the inputs, keyword arguments included. Arguments and errors as in
        :meth:`register_forward_hook`.
        """
        return self._register("forward_pre_hook", fn, modules, hook_fn_name, activate, named_modules)

    def register_backward_hook(
        self, fn: Callable[..., Any], /, *modules: nn.Module, hook_fn_name: str | None = None,
        activate: bool = True, **named_modules: nn.Module,
    ) -> HookFunction:
        """Register ``fn(module, grad_in, grad_out)`` to run once per module call per backward pass.

        ``grad_in[i]`` is the gradient w.r.t. ``inputs[i]`` flowing through this call of the
        module, ``grad_out[i]`` the gradient w.r.t. ``outputs[i]``; ``None`` where there is no
        gradient. The return value is ignored. See ``docs/hooks.md`` for when it fires.
        Arguments and errors as in :meth:`register_forward_hook`.
        """
        return self._register("backward_hook", fn, modules, hook_fn_name, activate, named_modules)

    def _register(
        self, category: str, fn: Any, modules: tuple, hook_fn_name: str | None, activate: bool,
        named_modules: dict[str, Any],
    ) -> HookFunction:
        if isinstance(fn, HookFunction):
            hook_fn_name = fn.name if hook_fn_name is None else hook_fn_name
            fn = fn.fn
        if not callable(fn):
            raise HookTypeError(f"hook function must be callable, got {type(fn).__name__} {fn!r:.80}")
        name = repr(fn) if hook_fn_name is None else hook_fn_name
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"hook_fn_name must be a non-empty str, got {name!r}")
        hook_fn = self.name_to_hookfn.get(name)
        if hook_fn is not None and (hook_fn.fn != fn or hook_fn.category != category):
            raise DuplicateNameError(
                f"hook function name {name!r} is already registered for {hook_fn.fn!r} as a "
                f"{hook_fn.category}; pass a different hook_fn_name= for {fn!r} as a {category}"
            )
        targets = self._resolve_targets(modules, named_modules)
        for module_name, module in targets:
            if hook_fn is not None and module in hook_fn.module_to_handle:
                raise DuplicateNameError(
                    f"hook function {name!r} is already registered on module {module_name!r} "
                    f"(handle {hook_fn.module_to_handle[module].name!r}); remove it first or pass "
                    "another hook_fn_name= to hook the module twice"
                )
        bind = getattr(fn, "_hookline_bind", None)
        if bind is not None:
            _check_stored_names(category, name, targets)
        if hook_fn is None:
            hook_fn = self.name_to_hookfn[name] = HookFunction(fn, name, category)
        created = [self._add_handle(hook_fn, module_name, module) for module_name, module in targets]
        try:
            for handle in created:
                if activate:
                    handle.activate()
                if bind is not None:
                    bind(handle)
        except BaseException:
            for handle in created:
                handle.remove()
            raise
        return hook_fn

    def _resolve_targets(self, modules: tuple, named_modules: dict[str, Any]) -> list[tuple[str, nn.Module]]:
        """Names for the target modules; validates everything before anything is changed."""
        taken = dict(self.name_to_module)
        targets: list[tuple[str, nn.Module]] = []
        seen: set[int] = set()
        for given, module in [(None, m) for m in modules] + list(named_modules.items()):
            if not isinstance(module, nn.Module):
                what = "module" if given is None else f"module {given!r}"
                raise HookTypeError(
                    f"can only hook torch.nn.Module objects; {what} is a {type(module).__name__}: "
                    f"{module!r:.80}"
                )
            if id(module) in seen:
                raise DuplicateNameError(f"module {_short(module)} is passed twice in one registration")
            seen.add(id(module))
            known = self.module_to_name.get(module)
            if given is None:
                given = known if known is not None else self._derive_name(module, taken)
            elif known is not None and known != given:
                raise DuplicateNameError(
                    f"module {_short(module)} is already registered as {known!r}, cannot also name it "
                    f"{given!r}; register it as {known!r} (or pass it positionally)"
                )
            other = taken.get(given)
            if other is not None and other is not module:
                raise DuplicateNameError(
                    f"module name {given!r} already denotes {_short(other)}; cannot use it for "
                    f"{_short(module)}: choose another name"
                )
            taken[given] = module
            targets.append((given, module))
        return targets

    @staticmethod
    def _derive_name(module: nn.Module, taken: dict[str, nn.Module]) -> str:
        base = type(module).__name__
        return next(f"{base}_{n}" for n in itertools.count() if f"{base}_{n}" not in taken)

    def _add_handle(self, hook_fn: HookFunction, module_name: str, module: nn.Module) -> HookHandle:
        slot = self._slots.get(module)
        if slot is None:
            slot = self._slots[module] = ModuleHooks(module)
            self.name_to_module[module_name] = module
            self.module_to_name[module] = module_name
            users = _NAME_USERS.get(module)
            if users is not None:  # another manager named it: its name stays (see _forget)
                users.append((id(self), module_name))
            elif not hasattr(module, "name"):
                module.name = module_name
                _NAME_USERS[module] = [(id(self), module_name)]
        slot.registered += 1
        handle = HookHandle(hook_fn, module, module_name, slot, next(self._order), self._forget)
        hook_fn.module_to_handle[module] = handle
        self.name_to_hookhandle[handle.name] = handle
        return handle

    def _forget(self, handle: HookHandle) -> None:
        """Purge a removed handle (its ``on_remove``, called by :meth:`HookHandle.remove`)."""
        hook_fn, module = handle.hook_fn, handle.module
        if self.name_to_hookhandle.get(handle.name) is handle:
            del self.name_to_hookhandle[handle.name]
        if hook_fn.module_to_handle.get(module) is handle:
            del hook_fn.module_to_handle[module]
        if not hook_fn.module_to_handle and self.name_to_hookfn.get(hook_fn.name) is hook_fn:
            del self.name_to_hookfn[hook_fn.name]
        slot = self._slots.get(module)
        if slot is not None and slot.registered == 1:
            name = self.module_to_name.pop(module, None)
            self.name_to_module.pop(name, None)  # type: ignore[arg-type]
            del self._slots[module]
            slot.close()
            _release_name(module, id(self))
        elif slot is not None:
            slot.registered -= 1
        unbind = getattr(hook_fn.fn, "_hookline_unbind", None)
        if unbind is not None:
            unbind(handle)

    # --- selection -------------------------------------------------------------------------
    def _hook_fns(self, hook_types: HookTypes) -> list[HookFunction] | None:
        if hook_types is None:
            return None
        if isinstance(hook_types, (str, HookFunction)) or callable(hook_types):
            hook_types = [hook_types]
        found: list[HookFunction] = []
        for t in hook_types:
            if isinstance(t, str):
                if t not in self.name_to_hookfn:
                    raise _unknown("hook function name", t, self.name_to_hookfn)
                found.append(self.name_to_hookfn[t])
            elif isinstance(t, HookFunction):
                if self.name_to_hookfn.get(t.name) is not t:
                    raise _unknown("hook function (removed?)", t.name, self.name_to_hookfn)
                found.append(t)
            else:
                matches = [hf for hf in self.name_to_hookfn.values() if hf.fn == t]
                if not matches:
                    raise _unknown("hook function", t, self.name_to_hookfn)
                found.extend(matches)
        return found

    def _modules(self, modules: Iterable[Any]) -> list[nn.Module]:
        out = []
        for m in modules:
            if not isinstance(m, nn.Module):
                raise HookTypeError(f"expected an nn.Module, got {type(m).__name__} {m!r:.80}")
            if m not in self._slots:
                raise UnknownNameError(
                    f"module {_short(m)} has no hooks registered with this manager; registered "
                    f"modules: {list(self.name_to_module)[:10]}"
                )
            out.append(m)
        return out

    def _modules_by_name(self, names: Iterable[str]) -> list[nn.Module]:
        out = []
        for n in names:
            if n not in self.name_to_module:
                raise _unknown("module name", n, self.name_to_module)
            out.append(self.name_to_module[n])
        return out

    def _select(
        self, modules: list[nn.Module] | None, hook_types: HookTypes, category: str
    ) -> list[HookHandle]:
        _check_category(category)
        fns = self._hook_fns(hook_types)
        chosen = None if modules is None else set(modules)
        return [
            h for h in self.name_to_hookhandle.values()
            if (chosen is None or h.module in chosen)
            and (fns is None or any(h.hook_fn is f for f in fns))
            and (category == "all" or h.hook_fn.category == category)
        ]

    def handles(
        self, *modules: nn.Module, hook_types: HookTypes = None, category: str = "all"
    ) -> list[HookHandle]:
        """The handles matching the filters (all modules when none is given), in registration order."""
        return self._select(self._modules(modules) if modules else None, hook_types, category)

    # --- activation ------------------------------------------------------------------------
    def activate_all_hooks(self, hook_types: HookTypes = None, category: str = "all") -> None:
        """Activate every registered hook, optionally filtered.

        Args:
            hook_types: only hooks of these functions: raw functions, HookFunctions or hook
                function names (a single one is accepted too).
            category: ``"all"``, ``"forward_hook"``, ``"forward_pre_hook"`` or ``"backward_hook"``.

        Raises:
            InvalidArgumentError: unknown category.
            UnknownNameError: a ``hook_types`` entry is not registered.
        """
        for h in self._select(None, hook_types, category):
            h.activate()

    activate_all_hook = activate_all_hooks  # the TackleBox README spells it so

    def deactivate_all_hooks(self, hook_types: HookTypes = None, category: str = "all") -> None:
        """Deactivate every registered hook, optionally filtered (see :meth:`activate_all_hooks`)."""
        for h in self._select(None, hook_types, category):
            h.deactivate()

    def activate_module_hooks(
        self, *modules: nn.Module, hook_types: HookTypes = None, category: str = "all"
    ) -> None:
        """Activate the hooks registered on ``modules`` (filters as :meth:`activate_all_hooks`).

        Raises:
            UnknownNameError: a module has no hooks registered with this manager.
        """
        for h in self._select(self._modules(modules), hook_types, category):
            h.activate()

    def deactivate_module_hooks(
        self, *modules: nn.Module, hook_types: HookTypes = None, category: str = "all"
    ) -> None:
        """Deactivate the hooks registered on ``modules`` (filters as :meth:`activate_all_hooks`)."""
        for h in self._select(self._modules(modules), hook_types, category):
            h.deactivate()

    def activate_module_hooks_by_name(
        self, *module_names: str, hook_types: HookTypes = None, category: str = "all"
    ) -> None:
        """:meth:`activate_module_hooks` with module names (UnknownNameError for unknown ones)."""
        for h in self._select(self._modules_by_name(module_names), hook_types, category):
            h.activate()

    def deactivate_module_hooks_by_name(
        self, *module_names: str, hook_types: HookTypes = None, category: str = "all"
    ) -> None:
        """:meth:`deactivate_module_hooks` with module names (UnknownNameError for unknown ones)."""
        for h in self._select(self._modules_by_name(module_names), hook_types, category):
            h.deactivate()

    def activate_hook_by_name(self, handle_id: str) -> None:
        """Activate one handle by id, e.g. ``"my_forward_hook[my_module]"``."""
        self._handle(handle_id).activate()

    def deactivate_hook_by_name(self, handle_id: str) -> None:
        """Deactivate one handle by id."""
        self._handle(handle_id).deactivate()

    def _handle(self, handle_id: str) -> HookHandle:
        if handle_id not in self.name_to_hookhandle:
            raise _unknown("hook handle id", handle_id, self.name_to_hookhandle)
        return self.name_to_hookhandle[handle_id]

    # --- contexts --------------------------------------------------------------------------
    def hook_all_context(self, hook_types: HookTypes = None, category: str = "all") -> HookContext:
        """A context that activates the selected hooks on entry and restores their state on exit.

        Nothing happens until the ``with`` statement enters it; the selection is made on entry.
        On exit (also on exceptions) every selected handle returns to its state before entry.

        Example:
            >>> with mgr.hook_all_context(category="backward_hook"):
            ...     loss_fn(model(x)).backward()
        """
        _check_category(category)
        return HookContext(lambda: self._select(None, hook_types, category))

    def hook_module_context(
        self, *modules: nn.Module, hook_types: HookTypes = None, category: str = "all"
    ) -> HookContext:
        """:meth:`hook_all_context` restricted to the hooks on ``modules``."""
        _check_category(category)
        return HookContext(lambda: self._select(self._modules(modules), hook_types, category))

    def hook_module_context_by_name(
        self, *module_names: str, hook_types: HookTypes = None, category: str = "all"
    ) -> HookContext:
        """:meth:`hook_module_context` with module names."""
        _check_category(category)
        return HookContext(lambda: self._select(self._modules_by_name(module_names), hook_types, category))

    # --- removal ---------------------------------------------------------------------------
    def remove_hook_function(self, fn: HookType) -> None:
        """Remove a hook function (raw function, HookFunction or name) from every module.

        Raises:
            UnknownNameError: it is not registered (any more).
        """
        for hook_fn in self._hook_fns([fn]):  # type: ignore[union-attr]
            for handle in list(hook_fn.module_to_handle.values()):
                handle.remove()
            if self.name_to_hookfn.get(hook_fn.name) is hook_fn:  # registered on no module
                del self.name_to_hookfn[hook_fn.name]

    def remove_hook_function_by_name(self, hook_fn_name: str) -> None:
        """Remove the hook function registered as ``hook_fn_name`` from every module."""
        if hook_fn_name not in self.name_to_hookfn:
            raise _unknown("hook function name", hook_fn_name, self.name_to_hookfn)
        self.remove_hook_function(hook_fn_name)

    def remove_module(self, module: nn.Module) -> None:
        """Remove every hook registered on ``module``."""
        for h in self._select(self._modules([module]), None, "all"):
            h.remove()

    def remove_module_by_name(self, module_name: str) -> None:
        """Remove every hook registered on the module named ``module_name``."""
        self.remove_module(self._modules_by_name([module_name])[0])

    def remove_hook_by_name(self, handle_id: str) -> None:
        """Remove one handle by id, e.g. ``"my_forward_hook[my_module]"``."""
        self._handle(handle_id).remove()

    def remove_all_hooks(self) -> None:
        """Remove every registered hook (the manager is empty afterwards)."""
        for h in list(self.name_to_hookhandle.values()):
            h.remove()


class HookContext:
    """Activates a selection of handles on ``__enter__`` and restores their states on ``__exit__``.

    Returned by :meth:`HookManager.hook_all_context` and friends; re-entrant (each entry saves
    its own states).
    """

    def __init__(self, select: Callable[[], list[HookHandle]]) -> None:
        self._select = select
        self._saved: list[list[tuple[HookHandle, bool]]] = []

    def __enter__(self) -> HookContext:
        handles = self._select()
        saved = [(h, h.active) for h in handles]
        self._saved.append(saved)
        try:
            for h in handles:
                h.activate()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for h, was_active in self._saved.pop():
            if was_active and not h.removed:
                h.activate()
            else:
                h.deactivate()
