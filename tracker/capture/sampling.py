"""Which steps a recorder records, and where it stands: the current step, paused(), closed."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

from hookline.storage.errors import HookTypeError, InvalidArgumentError, WriterClosedError
from hookline.storage.format import MAX_STEP

__all__ = ["StepState", "check_sampling", "check_step", "steps_meta"]

#: ``steps=`` longer than this are summarised in the run metadata (which every handle file and
#: the manifest carry) instead of listed.
_STEPS_LISTED = 256


def check_step(n: Any) -> int:
    """``n`` as a step number (an int in ``[0, MAX_STEP]``).

    Raises:
        HookTypeError: not an int.
        InvalidArgumentError: negative or beyond int64.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise HookTypeError(
            f"step must be an int, got {type(n).__name__} {n!r:.60} (e.g. rec.set_step(int(step)))")
    if not 0 <= n <= MAX_STEP:
        raise InvalidArgumentError(f"step must be a non-negative int up to 2**63 - 1 (stored as int64), got {n!r}")
    return int(n)


def check_sampling(every: Any, steps: Iterable[int] | None) -> tuple[int, frozenset[int] | None]:
    """Validate a recorder's ``every=`` and ``steps=`` arguments (at most one of them given).

    Returns:
        ``(every, steps)`` as an int and a frozenset of step numbers (or None).

    Raises:
        HookTypeError: ``every`` is not an int, ``steps`` not an iterable of ints.
        InvalidArgumentError: ``every`` < 1, both given, or a step out of range.
    """
    if isinstance(every, bool) or not isinstance(every, (int, np.integer)):
        raise HookTypeError(f"every must be an int (record every N-th step), got {type(every).__name__} {every!r:.60}")
    if every < 1:
        raise InvalidArgumentError(f"every must be a positive int (record every N-th step), got {every!r}")
    every = int(every)
    if steps is None:
        return every, None
    if every != 1:
        raise InvalidArgumentError(
            f"give either every={every!r} or steps=..., not both"
        )
    if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
        raise HookTypeError(
            f"steps must be an iterable of step numbers (e.g. range(0, 1000, 50)), got "
            f"{type(steps).__name__} {steps!r:.60}")
    return every, frozenset(check_step(s) for s in steps)


def steps_meta(steps: frozenset[int] | None) -> list[int] | dict[str, Any] | None:
    """The ``steps`` run metadata: the sorted list, or for long ones ``{"count", "first", "last",
    "stride"}`` (``stride`` when they are evenly spaced, else None)."""
    if steps is None:
        return None
    ordered = sorted(steps)
    if len(ordered) <= _STEPS_LISTED:
        return ordered
    stride = ordered[1] - ordered[0]
    even = all(b - a == stride for a, b in zip(ordered, ordered[1:]))
    return {"count": len(ordered), "first": ordered[0], "last": ordered[-1], "stride": stride if even else None}


class StepState:
    """Where one recorder stands: its current step, whether that step is sampled, the depth of
    ``paused()`` contexts, and whether it is closed.

    The recorder moves it; its handle bindings read it on every firing. :attr:`lock` guards it
    and the bindings' tables (CUDA backward hooks run on autograd's device threads).

    Args:
        every, steps: the sampling setting (see :func:`check_sampling`).
        run_dir: the run directory, named in errors.
    """

    def __init__(self, every: int, steps: frozenset[int] | None, run_dir: str) -> None:
        self.every = every
        self.steps = steps
        self.run_dir = run_dir
        self.step: int | None = None
        self.sampled = True
        self.paused = 0  # depth of paused() contexts
        self.closed = False
        #: the current step released the handles at some moment (sampled, not paused)
        self.released = False
        #: a handle recorded in the current step
        self.fired = False
        self.lock = threading.Lock()

    def is_sampled(self, step: int) -> bool:
        """Whether ``step`` is recorded under the ``every``/``steps`` setting."""
        return step in self.steps if self.steps is not None else step % self.every == 0

    @property
    def holds_off(self) -> bool:
        """Whether the recorder's handles are suspended: a step it does not sample, or paused."""
        return self.paused > 0 or not self.sampled

    def enter(self, step: int) -> bool:
        """Make ``step`` the current step (hold :attr:`lock`).

        Returns:
            Whether the step's sampling differs from the previous one's (:attr:`holds_off` may
            have changed: the handles' suspension is to be applied again).
        """
        sampled = self.is_sampled(step)
        if step != self.step:
            self.fired = False
            self.released = False
        self.step = step
        self.released = self.released or (sampled and not self.paused)
        if sampled == self.sampled:
            return False
        self.sampled = sampled
        return True

    @property
    def recorded_nothing(self) -> bool:
        """Whether the current step is sampled, released its handles at some moment, and no
        handle recorded in it (checked when the step ends)."""
        return self.step is not None and self.sampled and self.released and not self.fired

    def check_open(self) -> None:
        """Raise WriterClosedError once the recorder is closed."""
        if self.closed:
            raise WriterClosedError(
                f"the recorder for {self.run_dir!r} is closed; create a new Recorder to record more"
            )
