"""Removing this process's segments at interpreter exit, and ending its queue writers.

A segment's creator removes it when the creating object is dropped, but Python does not
promise to drop objects at exit (a queue kept in a module-level list, a loan still
alive, a daemon thread's locals). So the core notes every segment and socket directory
this process creates while it exists (one registry, in the core: ``segment/created.rs``'s
``note_created``; this module keeps no list of its own), and an ``atexit`` hook removes
what is left (``_core.remove_created``): rings, tensor arenas, socket directories,
stores, encoder caches, probes, whatever still refers to them. Their memory stays mapped until the
process ends, so late users in this process and readers elsewhere are not cut off.

Before that, the hook shuts down the queue writers still alive, so that their readers
get every message sent and then "the writer shut down", not a hang or a "writer died".

Endings covered: the end of the script, ``sys.exit`` (also in a worker), exit with
daemon threads alive (also one blocked in a shmq call: the writer's shutdown ends it),
``KeyboardInterrupt`` (SIGINT's default).

Endings that run no exit hook — SIGTERM's and other signals' default action, SIGKILL (vLLM's
shutdown SIGKILLs an engine core or worker that lingers), a crash, ``os._exit`` — are
covered by the process's *janitor* (``shmq._janitor``), started with its first segment: a
small separate process that the core tells of every segment made and removed, and that
removes what is left once the process is gone. shmq installs **no signal handler** for
this: SIGTERM kills a process at once, as it would without shmq (the janitor removes its
segments within milliseconds), and a program's own handlers stay its own. Readers of a
writer killed that way get ``PeerDiedError``, not ``QueueShutDownError``: a program that
wants its readers told "shut down" handles SIGTERM itself and exits through ``sys.exit``.

Children of ``multiprocessing``'s ``fork`` and ``forkserver`` methods leave through
``os._exit`` once their target returns: no ``atexit`` there. multiprocessing runs its
exit finalizers (``multiprocessing.util.Finalize`` with an exit priority) just before,
so in such a child shmq registers its cleanup as one (from multiprocessing's after-fork
callbacks, or at import when the child imports shmq itself). It runs when the target has
returned (or raised, or called ``sys.exit``), after the child's own children are
joined but *before* its non-daemon threads are: a queue such a thread still uses is
shut down then (its calls raise ``QueueShutDownError``). A forked child starts without a
janitor (it closes the parent's socket) and starts its own with its first segment.

What a process leaves when even its janitor could not run (the janitor itself killed,
no interpreter to start one) is removed by ``python -m shmq cleanup``, which removes
segments whose creator is dead. No process removes another's segments on its own: a
segment's file exists a moment before its creator holds the lock that proves it alive,
so "nobody holds it" is no proof in a process that cannot know whether a creator is just
starting; ``cleanup`` is for an operator who knows.
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
