"""The warning of a recorder whose sampled step recorded nothing: no handle registered (an empty
selection, most often) or none of its handles called in the step."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

from hookline.tracker.hooks.select import empty_selections

__all__ = ["EmptyStepCheck"]

#: Frames of hookline itself and of contextlib are skipped: the warning points at the user's line.
_SKIP = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.abspath(contextlib.__file__))
#: Handles named in the message, at most.
_SHOWN = 4


def _user_level() -> int:
    """``stacklevel`` of the first frame outside hookline and contextlib, counted from the
    caller of ``warnings.warn`` (this module's :meth:`EmptyStepCheck.step_ended`)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_SKIP):
        frame, level = frame.f_back, level + 1
    return level


class EmptyStepCheck:
    """Warns once per recorder when a sampled step ends with no record.

    Args:
        run_dir: the recorder's run directory (named in the message).
    """

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.warned = False

    def step_ended(self, step: int, handles: list[str]) -> None:
        """A sampled step (whose hooks were released) ended with no record.

        Args:
            step: the step.
            handles: the ids of the recorder's bound handles (none: nothing registered).
        """
        if self.warned:
            return
        self.warned = True
        head = f"hookline: Recorder({self.run_dir!r}) recorded nothing in sampled step {step}: "
        if handles:
            shown = ", ".join(handles[:_SHOWN]) + (f" and {len(handles) - _SHOWN} more" if len(handles) > _SHOWN else "")
            why = (f"none of its {len(handles)} handle{'s' if len(handles) > 1 else ''} ({shown}) was called in "
                   "the step. Are these modules called by the forward/backward run inside `with rec.step(n):`, "
                   "and are their hooks active (mgr.activate_all_hooks())?")
        else:
            why = ("no hook handle is registered with it. A select() pattern that matches no module registers "
                   "nothing (the registration returns a HookFunction with 0 modules)")
            empty = empty_selections()
            why += f": {empty[-1]}." if empty else "; register rec.outputs / rec.grads through a HookManager."
        warnings.warn(head + why + " (said once per recorder)", RuntimeWarning, stacklevel=_user_level())
