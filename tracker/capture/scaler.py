"""Recording under a ``torch.amp.GradScaler``: gradients unscaled, and the steps whose scaler found inf/NaN.

``Recorder(..., grad_scaler=scaler)`` gives its ``grads`` hooks a :class:`GradUnscaler`: each
floating gradient is multiplied by the inverse of the scale in effect for that backward pass, as
``scaler.unscale_`` computes it (``scale.double().reciprocal().float()``), in float32 (float64
gradients stay float64), so an fp16 gradient that the scale kept representable is neither
flushed to zero nor overflows. The scale is read as the device tensor it is: no ``.item()``, no
device synchronisation in hooks. Non-finite gradients are kept as they are (divided too).

:class:`InfSteps` finds the steps whose scaler found inf/NaN without asking the scaler (which
only keeps that per optimizer until ``update()``): ``scaler.update()`` lowers the scale (by its
``backoff_factor`` < 1) exactly when it found inf/NaN, so the scale after a step is compared with
the scale the step started with, on the device; the flag is read once it is on the host (CPU:
at once; CUDA: a ``non_blocking`` copy and an event, polled at the next step boundaries, waited
for at ``flush()``/``close()``). This assumes one ``scaler.update()`` per recorder step, as in the
usual loop; a step whose ``update()`` had not run by ``close()`` is not listed.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hookline.storage.errors import HookTypeError, InvalidArgumentError
from hookline.tracker.hooks.pytree import Leaves

__all__ = ["GradUnscaler", "InfSteps", "check_scaler"]


def check_scaler(scaler: Any, meta: Any = None, inf_key: str = "found_inf_steps") -> torch.amp.GradScaler | None:
    """``scaler`` if it is a ``torch.amp.GradScaler`` (or None), and ``meta`` free of the key
    the recorder writes with one.

    Raises:
        HookTypeError: anything else.
        InvalidArgumentError: ``meta`` holds ``inf_key`` while a scaler is given.
    """
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise HookTypeError(
            f"grad_scaler must be a torch.amp.GradScaler (the one whose scale() the loss goes "
            f"through), got {type(scaler).__name__} {scaler!r:.60}"
        )
    if scaler is not None and meta and inf_key in meta:
        raise InvalidArgumentError(f"meta key {inf_key!r} is written by the recorder (grad_scaler=...); rename it")
    return scaler


class GradUnscaler:
    """The gradients of one firing divided by the scale in effect (see the module docstring)."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self._scaler = scaler
        self._inv: tuple[int, int, torch.device, torch.Tensor] | None = None  # scale id, version, device, inverse

    def _inverse(self, scale: torch.Tensor, device: torch.device) -> torch.Tensor:
        cached = self._inv
        key = (id(scale), scale._version, device)
        if cached is not None and cached[:3] == key:
            return cached[3]
        # as GradScaler.unscale_ computes it; update() changes the scale in place (a new version)
        inv = scale.double().reciprocal().float().to(device, non_blocking=True)
        self._inv = (*key, inv)
        return inv

    def __call__(self, leaves: Leaves) -> Leaves:
        scaler = self._scaler
        scale = scaler._scale  # (no public accessor that does not synchronise)
        if scale is None or not scaler.is_enabled():
            return leaves  # scale() not called yet: nothing is scaled
        out = []
        for g in leaves:
            if g is None or not g.is_floating_point():
                out.append(g)
                continue
            wide = torch.float64 if g.dtype == torch.float64 else torch.float32
            out.append(g.detach().to(wide) * self._inverse(scale, g.device))
        return Leaves(out, leaves.paths, leaves.skipped)


class InfSteps:
    """The steps whose scaler found inf/NaN (see the module docstring).

    Args:
        scaler: the recorder's ``GradScaler``.
        found: called with the sorted list of such steps whenever it grows.
    """

    def __init__(self, scaler: torch.amp.GradScaler, found: Callable[[list[int]], None]) -> None:
        self._scaler = scaler
        self._found = found
        self._steps: set[int] = set()
        self._start: tuple[int, torch.Tensor | float] | None = None  # the current step, its scale
        # (step, host flag, event or None): comparisons not yet read
        self._pending: list[tuple[int, torch.Tensor, Any]] = []

    def boundary(self, step: int | None) -> None:
        """A step ends (the one started last) and ``step`` starts (None: none, at close)."""
        if self._start is not None and self._start[0] == step:
            return  # the same step entered again (nested)
        scaler = self._scaler
        scale = scaler._scale
        if self._start is not None and scale is not None and scaler.is_enabled():
            prev, before = self._start
            self._pending.append((prev, *self._to_host(scale < before)))
        if step is not None:
            # scale() has not run before the first step: the scale then is the initial one
            before = scale.clone() if scale is not None else float(scaler._init_scale)
            self._start = (step, before)
        self.read(wait=False)

    @staticmethod
    def _to_host(flag: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if flag.device.type != "cuda":
            return flag, None
        host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def read(self, wait: bool) -> None:
        """Read the flags that reached the host (``wait``: all of them, waiting for the device)."""
        new = False
        keep = []
        for step, host, event in self._pending:
            if event is not None and not event.query():
                if not wait:
                    keep.append((step, host, event))
                    continue
                event.synchronize()
            if bool(host.any()):
                self._steps.add(step)
                new = True
        self._pending = keep
        if new:
            self._found(sorted(self._steps))

    def close(self) -> None:
        """The last step ended (its ``update()`` ran): compare it too and read every flag."""
        self.boundary(None)
        self._start = None
        self.read(wait=True)
