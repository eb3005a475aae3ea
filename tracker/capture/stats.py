"""Per-record summaries for ``mode="stats"`` captures, computed on the tensor's own device.

Everything is computed with torch ops that stay on the device (no ``.item()``), stacked into one
small tensor per record, and copied to the host together with any other captured tensors, so a
stats capture never synchronises a CUDA device inside a hook.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["SCALAR_STATS", "StatsSpec", "compute_stats", "split_stats"]

#: Scalar statistics, in the order they are stacked; stored as fields ``<field>.<name>``.
SCALAR_STATS = ("norm", "mean", "std", "min", "max", "absmax")


#: Most histogram bins (512 KiB of float64 per record and handle: more is a mistake, not a histogram).
MAX_BINS = 65536


class StatsSpec:
    """Fixed histogram bins for ``.hist`` fields.

    Args:
        bins: number of bins, 1 to :data:`MAX_BINS` (each record stores them as float64).
        range: ``(low, high)`` of the bin edges. Values outside are counted in the first/last
            bin (clamped), so every element is counted; NaNs are not counted.

    Raises:
        InvalidArgumentError: ``bins`` is not an int in ``[1, MAX_BINS]``, or the range is not two
            finite numbers with ``low < high``.
    """

    def __init__(self, bins: int = 64, range: tuple[float, float] = (-8.0, 8.0)) -> None:
        from hookline.storage.errors import InvalidArgumentError

        try:
            lo, hi = (float(v) for v in range)  # exactly two numbers
        except (TypeError, ValueError):
            lo = hi = math.nan
        if (isinstance(bins, bool) or not isinstance(bins, int) or not 1 <= bins <= MAX_BINS or not lo < hi
                or not math.isfinite(hi - lo)):
            raise InvalidArgumentError(
                f"stats histogram needs an int bins from 1 to {MAX_BINS} and a finite range low < high, got "
                f"bins={bins!r:.40}, range={range!r:.80}; e.g. StatsSpec(bins=64, range=(-8.0, 8.0))"
            )
        self.bins, self.low, self.high = bins, lo, hi

    @property
    def edges(self) -> np.ndarray:
        """The ``bins + 1`` bin edges (float64)."""
        return np.linspace(self.low, self.high, self.bins + 1)


def compute_stats(t: torch.Tensor, spec: StatsSpec) -> torch.Tensor:
    """Return ``[norm, mean, std, min, max, absmax, *hist]`` of ``t`` as one float64 tensor.

    Complex tensors are summarised by their magnitude; bool and integer tensors as float64.
    ``std`` is the population standard deviation (``correction=0``). An empty tensor gives NaN
    scalars and an all-zero histogram.
    """
    x = t.detach()
    if x.is_complex():
        x = x.abs()
    x = x.to(torch.float64).reshape(-1)
    if x.numel() == 0:
        scalars = torch.full((len(SCALAR_STATS),), float("nan"), dtype=torch.float64, device=x.device)
        return torch.cat([scalars, torch.zeros(spec.bins, dtype=torch.float64, device=x.device)])
    mn, mx = torch.aminmax(x)
    scalars = torch.stack(
        [
            torch.linalg.vector_norm(x),
            x.mean(),
            x.std(correction=0),
            mn,
            mx,
            torch.maximum(mx.abs(), mn.abs()),
        ]
    )
    hist = torch.histc(x.clamp(spec.low, spec.high), bins=spec.bins, min=spec.low, max=spec.high)
    return torch.cat([scalars, hist])


def split_stats(prefix: str, packed: np.ndarray) -> dict[str, np.ndarray]:
    """Turn host copies of :func:`compute_stats` into storage fields named ``<prefix>.<stat>``.

    ``packed`` is one record (1-D) or a block of records stacked along a first axis (2-D); the
    fields are fresh contiguous arrays (``()``/``(bins,)`` per record, with the block's first axis).
    """
    out = {f"{prefix}.{name}": packed[..., i].copy() for i, name in enumerate(SCALAR_STATS)}
    out[f"{prefix}.hist"] = packed[..., len(SCALAR_STATS):].copy()
    return out
