"""Recording inside ``torch.compile`` graphs: an opaque, ordered custom op hands tensors to the recorder.

While Dynamo traces a hooked module, the recorder's forward capture hooks (``rec.inputs``,
``rec.outputs``) do not run their Python recording path (Dynamo cannot trace the packer, and a
graph break per module would cost every sampled step). They put one ``hookline::record`` op into
the graph instead. The op is opaque to the compiler (its fake kernel does nothing, so it costs no
tracing) and registered as an *ordered effect*, so AOTAutograd threads an effect token through it
and Inductor neither drops it (it returns nothing) nor reorders it. When the compiled graph runs,
the op's kernel hands the real tensors to the recorder's usual path (:class:`RecordTargets`),
which numbers the call and copies them as in eager mode: ``fullgraph=True`` works.

The graph holds a token (an int) per bound handle: :class:`RecordTargets` maps tokens to the
capture hook and its binding. A graph keeps a token that names a removed handle harmlessly:
the op then records nothing (Dynamo guards on the module's hooks, so such a graph no longer runs
for that module anyway).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable

import torch

from hookline.storage.errors import HookFunctionError
from hookline.tracker.hooks.pytree import Leaves

__all__ = ["RecordTargets", "TARGETS", "record_in_graph"]


class RecordTargets:
    """Token -> ``(record function, binding)`` for the handles compiled graphs may record into.

    The record function is called as ``fn(binding, leaves, t0)`` on the training thread, when
    the compiled graph runs.
    """

    def __init__(self) -> None:
        self._next = itertools.count(1)
        self._targets: dict[int, tuple[Callable[[Any, Leaves, int], None], Any]] = {}
        self._lock = threading.Lock()

    def add(self, fn: Callable[[Any, Leaves, int], None], binding: Any) -> int:
        """A new token for ``binding`` (recorded through ``fn``)."""
        with self._lock:
            token = next(self._next)
            self._targets[token] = (fn, binding)
        return token

    def discard(self, token: int) -> None:
        """Forget a token (its handle was removed); a graph still holding it records nothing."""
        with self._lock:
            self._targets.pop(token, None)

    def __len__(self) -> int:
        return len(self._targets)

    def fire(self, token: int, tensors: list[torch.Tensor], paths: list[str], skipped: list[str]) -> None:
        """Run the recording of one firing inside a compiled graph (the op's kernel)."""
        t0 = time.perf_counter_ns()
        target = self._targets.get(token)
        if target is None:
            return
        fn, binding = target
        handle = binding.handle
        if not handle.runs:
            return  # deactivated or suspended while this graph stayed valid
        try:
            fn(binding, Leaves(tensors, tuple(paths), tuple(skipped)), t0)
        except Exception as e:
            # As HookHandle.call reports an eager hook's failure.
            raise HookFunctionError(
                f"hook {handle.name!r} raised {type(e).__name__}: {e} "
                "(the original exception is chained as __cause__)"
            ) from e


#: The process's targets (tokens are baked into compiled graphs, which outlive recorders).
TARGETS = RecordTargets()


# (Custom ops take no list of str: the paths travel NUL-joined, which no path holds: names that
# enter a run may hold no control character.)
_SEP = "\x00"


@torch.library.custom_op("hookline::record", mutates_args=())
def _record_op(tensors: list[torch.Tensor], token: int, paths: str, skipped: str, n_skipped: int) -> None:
    TARGETS.fire(token, tensors, paths.split(_SEP) if tensors else [],
                 skipped.split(_SEP) if n_skipped else [])


@_record_op.register_fake
def _record_fake(tensors: list[torch.Tensor], token: int, paths: str, skipped: str, n_skipped: int) -> None:
    return None


# Ordered effect: kept although it returns nothing, and never moved past other effects.
_record_op.register_effect(torch.library.EffectType.ORDERED)


def record_in_graph(token: int, leaves: Leaves) -> None:
    """Put one ``hookline::record`` op for ``leaves`` into the graph being traced."""
    skipped = leaves.skipped
    torch.ops.hookline.record(list(leaves), token, _SEP.join(leaves.paths), _SEP.join(skipped), len(skipped))
