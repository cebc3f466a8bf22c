"""Removing this process's segments at interpreter exit.

A segment's creator removes it when the creating object is dropped, but Python does not
promise to drop objects at exit. Every segment this process creates is registered here
(weakly), and an ``atexit`` hook removes the names of those still alive; their memory
stays mapped until the process ends, so late users are not cut off.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Protocol


class _Unlinkable(Protocol):
    def unlink(self) -> None: ...


_created: "weakref.WeakSet[_Unlinkable]" = weakref.WeakSet()


def track(segment: _Unlinkable) -> None:
    """Remove ``segment`` (a ``_core`` object this process created) at exit."""
    _created.add(segment)


@atexit.register
def _unlink_created_segments() -> None:
    for segment in list(_created):
        try:
            segment.unlink()
        except OSError:
            pass
