"""Whether the running forward is activation checkpointing's recomputation (``is_recomputing``).

``torch.utils.checkpoint`` (reentrant or not, and Hugging Face's
``gradient_checkpointing_enable()``, which uses it) runs a checkpointed segment's forward a second
time during the backward pass, and torch calls module forward hooks again then. The recorder
does not record such a recomputation (it is not a new call: the forward was recorded when it ran);
the :class:`~hookline.tracker.HookManager` keeps torch's semantics and calls every hook, so a
user's own hook can call :func:`is_recomputing` to tell the two apart.
"""

from __future__ import annotations

import sys

import torch
import torch.utils.checkpoint as _checkpoint

__all__ = ["is_recomputing"]

_graph_task_id = torch._C._current_graph_task_id
# The functions checkpointing recomputes a segment in: the reentrant Function's backward, and
# the non-reentrant variant's recompute closure.
_CHECKPOINT_FILE = _checkpoint.__file__
_REENTRANT_BACKWARD = _checkpoint.CheckpointFunction.backward.__code__


def is_recomputing() -> bool:
    """Whether the caller runs inside a forward that activation checkpointing recomputes.

    True inside module forwards (and their hooks) that ``torch.utils.checkpoint`` runs again
    during the backward pass, for ``use_reentrant=True`` and ``False`` alike; False during the
    original forward and outside checkpointing. Cheap outside a backward pass (one C call); while
    autograd runs a backward pass it looks up the caller's frames for checkpointing's recompute.

    Example:
        >>> def my_hook(module, inputs, outputs):
        ...     if hookline.tracker.is_recomputing():
        ...         return  # the same call again, recomputed for its gradient
        ...     log_activation(outputs[0])
    """
    if _graph_task_id() < 0:
        return False  # a recomputation runs only inside a backward pass
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code is _REENTRANT_BACKWARD or (code.co_name == "recompute_fn" and code.co_filename == _CHECKPOINT_FILE):
            return True
        frame = frame.f_back
    return False
