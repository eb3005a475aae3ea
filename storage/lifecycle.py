"""Closing objects at interpreter exit without keeping them alive: :func:`weak_closer`."""

from __future__ import annotations

import weakref
from typing import Any, Callable

__all__ = ["weak_closer"]


def weak_closer(obj: Any, on_error: Callable[[Any, Exception], None] | None = None) -> Callable[[], None]:
    """An ``atexit`` callback that closes ``obj`` if it is still alive, without keeping it alive.

    ``obj.close()`` must be idempotent (an object closed before exit is closed again, as a no-op).
    Errors go to ``on_error(obj, exc)`` (default: ignored; at exit there is no caller left to raise
    to). Used by :class:`~hookline.storage.RunWriter` and the tracker's ``Recorder``.

    Args:
        obj: the object to close.
        on_error: called with ``obj`` and the exception when ``close()`` raises.

    Returns:
        The callback (register it with ``atexit.register``; unregister it in ``close()``).
    """
    ref = weakref.ref(obj)

    def close() -> None:
        o = ref()
        if o is not None:
            try:
                o.close()
            except Exception as e:
                if on_error is not None:
                    on_error(o, e)

    return close
