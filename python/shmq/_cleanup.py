"""Removing this process's segments at interpreter exit, and ending its queue writers.

A segment's creator removes it when the creating object is dropped, but Python does not
promise to drop objects at exit (a queue kept in a module-level list, a loan still
alive, a daemon thread's locals). So the core notes every segment and socket directory
this process creates while it exists, and an ``atexit`` hook removes what is left
(``_core.remove_created``): rings, tensor arenas, socket directories, stores, encoder
caches, probes, whatever still refers to them. Their memory stays mapped until the
process ends, so late users in this process and readers elsewhere are not cut off.

Before that, the hook shuts down the queue writers still alive, so that their readers
get every message sent and then "the writer shut down", not a hang or a "writer died".

Endings covered: the end of the script, ``sys.exit`` (also in a worker), exit with
daemon threads alive (also one blocked in a shmq call: the writer's shutdown ends it),
``KeyboardInterrupt`` (SIGINT's default), and SIGTERM: its default action kills the
process without running ``atexit``, so when a process first creates a segment in its
main thread and has no SIGTERM handler of its own, shmq installs one that runs this
cleanup and then dies of SIGTERM as before (same exit status). Not at import, so a
handler set before is kept (``WorkerProcesses``' workers turn SIGTERM into
``SystemExit``, which runs the hook). The handler runs once the main thread executes
Python code (shmq's own waits look every few milliseconds). A program that installs its
own SIGTERM handler should exit through ``sys.exit`` in it.

Children of ``multiprocessing``'s ``fork`` and ``forkserver`` methods leave through
``os._exit`` once their target returns: no ``atexit`` there. multiprocessing runs its
exit finalizers (``multiprocessing.util.Finalize`` with an exit priority) just before,
so in such a child shmq registers its cleanup as one (from multiprocessing's after-fork
callbacks, or at import when the child imports shmq itself). It runs when the target has
returned (or raised, or called ``sys.exit``), after the child's own children are
joined but *before* its non-daemon threads are: a queue such a thread still uses is
shut down then (its calls raise ``QueueShutDownError``). A plain ``os.fork()`` child that
leaves through ``os._exit`` runs nothing of Python's: it cannot be helped (let it exit
through ``sys.exit``, or make nothing in it).

SIGKILL and crashes leave segments behind: ``python -m shmq cleanup`` removes those
whose creator is dead. Workers of ``WorkerProcesses`` whose parent is SIGKILLed remove
theirs themselves before they die (see ``shmq.workers.child``). No process removes
another's segments on its own: a segment's file exists a moment before its creator holds
the lock that proves it alive, so "nobody holds it" is no proof in a process that cannot
know whether a creator is just starting; ``cleanup`` is for an operator who knows.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import weakref
from typing import Any, Protocol

from . import _core


class _Unlinkable(Protocol):
    def unlink(self) -> None: ...


class _ShutsDown(Protocol):
    def shutdown(self) -> None: ...


_created: "weakref.WeakSet[_Unlinkable]" = weakref.WeakSet()
_writers: "weakref.WeakSet[_ShutsDown]" = weakref.WeakSet()


def track(segment: _Unlinkable) -> None:
    """Remove ``segment`` (a ``_core`` object this process created) at exit."""
    _created.add(segment)
    _install_sigterm_handler()


def track_writer(writer: _ShutsDown) -> None:
    """Shut ``writer`` (a ``_core.Writer``) down at exit, before its segments go."""
    _writers.add(writer)
    _install_sigterm_handler()


def _clean_up() -> None:
    for writer in list(_writers):
        try:
            writer.shutdown()
        except Exception:
            pass
    for segment in list(_created):
        try:
            segment.unlink()
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

_sigterm_checked = False


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM's default action (die of it), after removing what this process made."""
    try:
        _clean_up()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm_handler() -> None:
    """Handle SIGTERM (see the module docs) if nobody does: only in the main thread
    (where Python lets handlers be set) and only over the default action."""
    global _sigterm_checked
    if _sigterm_checked or threading.current_thread() is not threading.main_thread():
        return
    _sigterm_checked = True
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        pass  # not the main interpreter, or signals unavailable


def _after_fork_in_child() -> None:
    """A forked child starts afresh: it has created nothing yet (the core's list is kept
    per pid), its parent's writers are not its own, and the SIGTERM handler it inherited
    is shmq's, not its program's: back to the default, so that a handler the child sets
    (``WorkerProcesses``' workers do) decides, or shmq's again once it creates a segment."""
    global _sigterm_checked
    _sigterm_checked = False
    _writers.clear()
    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except (ValueError, OSError):
        pass


os.register_at_fork(after_in_child=_after_fork_in_child)
