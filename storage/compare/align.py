"""Pairing the handles of two runs by name, across frameworks: explicit ``rename=`` rules, and a
wrapper prefix (``model.``, ``module.``, ``_orig_mod.``) dropped when nothing pairs as recorded.

A handle id is ``<hook function>[<module name>]``. The Hugging Face ``Trainer`` records
``outputs[transformer.h.0.mlp]`` where Lightning records ``outputs[model.transformer.h.0.mlp]``
(its ``LightningModule`` holds the model as ``self.model``), DDP adds ``module.`` and
``torch.compile`` ``_orig_mod.``. Rules, in order:

1. ``rename`` (``{"OLD": "NEW"}``, the CLI's ``--map OLD=NEW``) rewrites names in both runs: an
   ``OLD`` equal to a handle id renames that handle; otherwise ``OLD`` is a dotted module-name
   prefix (``model`` matches ``model`` and ``model.*``, never ``models``) replaced by ``NEW``
   (empty ``NEW`` drops it).
2. Without ``rename``, when no handle pairs as recorded, every run whose module names all start
   with one wrapper prefix loses it (repeatedly: ``model.module.x`` -> ``x``); adopted only when
   handles then pair. (``rename`` is explicit: then nothing is dropped automatically.)

The result (:class:`Alignment`) names each pair by its aligned id and says what was done.
Reads the manifests only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import InvalidArgumentError

__all__ = ["WRAPPER_PREFIXES", "Alignment", "align_handles", "parse_rename"]

#: Leading module-name parts that frameworks add around the same model.
WRAPPER_PREFIXES: tuple[str, ...] = ("model.", "module.", "_orig_mod.")


@dataclass
class Alignment:
    """How the handles of run A and run B pair.

    Attributes:
        names: aligned handle names: run A's order, then run B's others.
        a, b: aligned name -> the handle id in run A / run B (absent: not in that run).
        note: what was renamed, in words, or ``None`` when the handles paired as recorded.
        renamed: handle id -> its aligned name, for the handles whose name changed.
    """

    names: list[str]
    a: dict[str, str]
    b: dict[str, str]
    note: str | None = None
    renamed: dict[str, str] = field(default_factory=dict)


def parse_rename(pairs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``["OLD=NEW", ...]`` (the CLI's ``--map``) as a dict.

    Raises:
        InvalidArgumentError: an item without ``=`` or with an empty ``OLD``.
    """
    out: dict[str, str] = {}
    for p in pairs:
        old, eq, new = p.partition("=")
        if not eq or not old:
            raise InvalidArgumentError(f"--map {p!r}: write OLD=NEW (e.g. model.transformer=transformer, or "
                                       f"model.= to drop a prefix)")
        out[old] = new
    return out


def _handles(run: Any) -> dict[str, str]:
    """Handle id -> module name (``None``-free; ids not of the form ``fn[module]`` map to '')."""
    out: dict[str, str] = {}
    for m in run.manifests:
        for hid, e in m["handles"].items():
            if hid not in out:
                mod, fn = str(e.get("module_name") or ""), str(e.get("hook_fn_name") or "")
                out[hid] = mod if hid == f"{fn}[{mod}]" else ""
    return out


def _with_module(hid: str, module: str, new_module: str) -> str:
    """The id ``fn[module]`` with its module name replaced."""
    return hid[: len(hid) - len(module) - 2] + f"[{new_module}]"


def _rule(module: str, old: str, new: str) -> str | None:
    """``module`` with the dotted prefix ``old`` replaced by ``new``, or None when it does not match."""
    old, new = old.rstrip("."), new.rstrip(".")
    if module == old:
        return new
    if module.startswith(old + "."):
        rest = module[len(old) + 1:]
        return f"{new}.{rest}" if new else rest
    return None


def _apply_rules(ids: dict[str, str], rename: Mapping[str, str], used: set[str]) -> dict[str, str]:
    """Handle id -> renamed id, for one run (``used`` collects the rules that matched)."""
    out: dict[str, str] = {}
    for hid, mod in ids.items():
        new = hid
        if hid in rename:
            new = rename[hid]
            used.add(hid)
        elif mod:
            for old, repl in rename.items():
                m = _rule(mod, old, repl)
                if m is not None:
                    new = _with_module(hid, mod, m)
                    used.add(old)
                    break
        out[hid] = new
    return out


def _check_unique(mapping: dict[str, str], which: str) -> None:
    seen: dict[str, str] = {}
    for hid, new in mapping.items():
        if new in seen:
            raise InvalidArgumentError(f"renaming makes {seen[new]!r} and {hid!r} of run {which} both {new!r}; "
                                       f"use rules that keep names apart")
        seen[new] = hid


def _wrapper(ids: dict[str, str]) -> str:
    """The wrapper prefix every module name of a run starts with ('' when none, or several)."""
    mods = [m for m in ids.values() if m]
    prefix = ""
    while mods:
        p = next((w for w in WRAPPER_PREFIXES if all(m.startswith(w) for m in mods)), None)
        if p is None or any(len(m) == len(p) for m in mods):
            break
        prefix += p
        mods = [m[len(p):] for m in mods]
    return prefix


def _strip(ids: dict[str, str], prefix: str) -> dict[str, str]:
    """Handle id -> id with ``prefix`` dropped from its module name."""
    return {hid: _with_module(hid, mod, mod[len(prefix):]) if mod and prefix else hid for hid, mod in ids.items()}


def _automatic(ids_a: dict[str, str], ids_b: dict[str, str]) -> tuple[dict[str, str], dict[str, str], str] | None:
    """Names with wrapper prefixes dropped, and the note saying so; None when that pairs nothing."""
    pa, pb = _wrapper(ids_a), _wrapper(ids_b)
    if not pa and not pb:
        return None
    sa, sb = _strip(ids_a, pa), _strip(ids_b, pb)
    if not set(sa.values()) & set(sb.values()):
        return None
    said = [f"run {w}'s module names start with {p!r}" for w, p in (("A", pa), ("B", pb)) if p]
    hid = next(h for h, m in (ids_b.items() if pb else ids_a.items()) if m)
    example = f"{hid!r} -> {(sb if pb else sa)[hid]!r}"
    return sa, sb, (f"no handle paired as recorded; {' and '.join(said)}: dropped to pair handles "
                    f"(e.g. {example}); pass rename= / --map OLD=NEW to choose")


def align_handles(run_a: Any, run_b: Any, rename: Mapping[str, str] | None = None) -> Alignment:
    """Pair the handles of two opened runs by name (see the module docstring).

    Raises:
        InvalidArgumentError: a ``rename`` rule that matches no handle of either run, or one
            that gives two handles of a run the same name.
    """
    ids_a, ids_b = _handles(run_a), _handles(run_b)
    rename = dict(rename or {})
    used: set[str] = set()
    na, nb = _apply_rules(ids_a, rename, used), _apply_rules(ids_b, rename, used)
    unused = [k for k in rename if k not in used]
    if unused:
        avail = sorted({m for m in (*ids_a.values(), *ids_b.values()) if m})[:6]
        raise InvalidArgumentError(f"rename {unused[0]!r} matches no handle id or module name in either run; "
                                   f"module names: {', '.join(avail) or '(none)'}")
    _check_unique(na, "A")
    _check_unique(nb, "B")
    notes = [f"renamed {', '.join(f'{k!r} -> {v!r}' for k, v in rename.items())}"] if rename else []
    if not rename and ids_a and ids_b and not set(na.values()) & set(nb.values()):
        auto = _automatic(ids_a, ids_b)
        if auto is not None:
            na, nb, said = auto
            notes.append(said)
    a = {new: hid for hid, new in na.items()}
    b = {new: hid for hid, new in nb.items()}
    names = list(a) + [n for n in b if n not in a]
    renamed = {hid: new for hid, new in (*na.items(), *nb.items()) if new != hid}
    return Alignment(names, a, b, "; ".join(notes) or None, renamed)
