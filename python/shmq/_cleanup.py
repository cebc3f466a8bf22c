"""Exit cleanup: at interpreter exit, shut down this process's live queue writers, then
remove the segments it created that are still there.

The core notes every segment and socket directory this process creates
(``segment/created.rs``'s ``note_created``); an ``atexit`` hook shuts down the queue
writers still alive (their readers get every message, then "the writer shut down") and
removes what is left (``_core.remove_created``), leaving the memory mapped until the
process ends. In a ``fork`` or ``forkserver`` child of ``multiprocessing`` (which leaves
through ``os._exit``) the hook is one of multiprocessing's exit finalizers instead. The
first segment starts this process's janitor (``shmq._janitor``), which covers the
endings that run no exit hook (SIGKILL, SIGTERM's default action, a crash,
``os._exit``); shmq installs no signal handler.

Which endings remove what: docs/operations.md ("Inspecting and cleaning up"); why it is
built this way: docs/design.md ("Exit cleanup and the janitor").
"""

from __future__ import annotations

import atexit
import os
import weakref
from typing import Protocol

from . import _core


class _ShutsDown(Protocol):
    def shutdown(self) -> None: ...


_writers: "weakref.WeakSet[_ShutsDown]" = weakref.WeakSet()


def created_segments() -> None:
    """Called once this process has created a segment: make sure its janitor runs (the
    core itself notes what was created, for the janitor and the exit hook)."""
    _ensure_janitor()


def track_writer(writer: _ShutsDown) -> None:
    """Shut ``writer`` (a ``_core.Writer``) down at exit, before its segments go."""
    _writers.add(writer)
    _ensure_janitor()


def _ensure_janitor() -> None:
    """Start this process's janitor (see the module docs), and a new one when the core
    found it gone (killed: noticed at the next name sent to it, whose segment then starts
    the new one, which is sent every name still noted); not again after a failed start,
    which leaves this process to its exit hook and ``cleanup``."""
    global _janitor_start
    if _janitor_start is False or (_janitor_start and _core.has_janitor()):
        return
    from . import _janitor

    _janitor_start = _janitor.start()


def _clean_up() -> None:
    for writer in list(_writers):
        try:
            writer.shutdown()
        except Exception:
            pass  # nothing may keep the others (and remove_created below) from running
    _core.remove_created()


# Registered before multiprocessing's own exit hook (multiprocessing.util is imported
# below, not earlier), so that it runs after it: in a parent, multiprocessing joins its
# non-daemon children first, which may still be opening this process's queues.
atexit.register(_clean_up)

import multiprocessing  # noqa: E402
import multiprocessing.util as mp_util  # noqa: E402


class _Anchor:
    """What multiprocessing's after-fork registry holds (weakly) for shmq."""


_anchor = _Anchor()


def _in_multiprocessing_child(_: object) -> None:
    """Run by multiprocessing in every child it starts, before the target. Children of
    the ``fork`` and ``forkserver`` methods leave through ``os._exit`` (no ``atexit``),
    after multiprocessing's exit finalizers: shmq's cleanup goes there."""
    process = multiprocessing.current_process()
    # Without fixing the start method (get_start_method() would, for the whole child):
    # the process's own, the one set, else the default (listed first).
    method = (
        getattr(process, "_start_method", None)
        or multiprocessing.get_start_method(allow_none=True)
        or multiprocessing.get_all_start_methods()[0]
    )
    if method in ("fork", "forkserver"):
        mp_util.Finalize(None, _clean_up, exitpriority=-100)


mp_util.register_after_fork(_anchor, _in_multiprocessing_child)
if multiprocessing.parent_process() is not None:
    # Imported in a child that multiprocessing has started already (its target imports
    # shmq): the after-fork callbacks have run, so register now.
    _in_multiprocessing_child(None)

# How this process's last janitor start went: None (none tried yet), True (started; a
# new one is started if the core finds it gone), False (failed: not tried again).
_janitor_start: bool | None = None


def _after_fork_in_child() -> None:
    """A forked child starts afresh: it has created nothing yet (the core's list is kept
    per pid), its parent's writers are not its own, and its parent's janitor is not its
    janitor: it closes its copy of that socket (so that the parent's janitor is not kept
    waiting for the child to end) and starts its own with its first segment."""
    global _janitor_start
    _janitor_start = None
    _writers.clear()
    _core.forget_inherited_janitor()


os.register_at_fork(after_in_child=_after_fork_in_child)
