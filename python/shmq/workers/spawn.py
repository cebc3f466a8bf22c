"""Spawned workers whose stderr goes into the parent's pipe from their first line of Python.

:class:`SpawnProcessWithStderr` starts a ``spawn`` child with multiprocessing's own
command line, whose program first ``dup2``s the pipe's write end onto fd 2: everything
the child writes to stderr after the interpreter has started (a traceback from
re-importing the main module or unpickling the target included) reaches the parent's
supervisor, its tail and the parent's stderr with the worker's prefix. Only what the
interpreter writes before it runs ``-c`` (a broken ``.pth`` file, say) still goes to
the inherited stderr. Why it is needed: docs/design.md ("Worker processes").

The launch below is CPython's ``multiprocessing.popen_spawn_posix.Popen._launch``
(identical in 3.11, 3.12 and 3.13), with one difference, marked: the command line and the
fds passed to the child. The stdlib offers no hook for either.
"""

from __future__ import annotations

import io
import multiprocessing.context
import os
import sys
from multiprocessing import popen_spawn_posix, reduction, spawn, util
from typing import Any

__all__ = ["SpawnProcessWithStderr", "can_capture_from_start"]


def can_capture_from_start(ctx: Any) -> bool:
    """Whether workers of ``ctx`` can be started by :class:`SpawnProcessWithStderr`: the
    plain spawn context of a normal (not frozen) interpreter, whose child runs ``-c``."""
    start_method = getattr(ctx, "get_start_method", lambda: None)()
    return (
        start_method == "spawn"
        and getattr(ctx, "Process", None) is multiprocessing.context.SpawnProcess
        and not getattr(sys, "frozen", False)
    )


def _with_stderr_from(cmd: list[str], fd: int) -> list[str]:
    """``cmd`` (spawn's command line) with ``fd`` put onto fd 2 before its program runs."""
    i = cmd.index("-c")  # can_capture_from_start ruled out the frozen form, which has none
    return [*cmd[: i + 1], f"import os; os.dup2({fd}, 2); os.close({fd}); " + cmd[i + 1], *cmd[i + 2 :]]


def _close_fds(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


class _PopenWithStderr(popen_spawn_posix.Popen):
    _fds: list[int]  # set by popen_spawn_posix.Popen.__init__: the fds the child inherits

    def _launch(self, process_obj: Any) -> None:
        from multiprocessing import resource_tracker

        tracker_fd = resource_tracker.getfd()
        assert tracker_fd is not None  # getfd() starts the tracker first
        self._fds.append(tracker_fd)
        prep_data = spawn.get_preparation_data(process_obj._name)
        fp = io.BytesIO()
        multiprocessing.context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, fp)
            reduction.dump(process_obj, fp)
        finally:
            multiprocessing.context.set_spawning_popen(None)

        parent_r = child_w = child_r = parent_w = None
        try:
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            cmd = spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
            # The difference from the stdlib: the child's stderr is the parent's pipe.
            stderr_fd = process_obj.stderr_fd
            cmd = _with_stderr_from(cmd, stderr_fd)
            self._fds.extend([child_r, child_w, stderr_fd])
            self.pid = util.spawnv_passfds(os.fsencode(spawn.get_executable()), cmd, self._fds)
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as f:
                f.write(fp.getbuffer())
        finally:
            fds_to_close = [fd for fd in (parent_r, parent_w) if fd is not None]
            self.finalizer = util.Finalize(self, _close_fds, fds_to_close)
            for fd in (child_r, child_w):
                if fd is not None:
                    os.close(fd)


class SpawnProcessWithStderr(multiprocessing.context.SpawnProcess):
    """A spawn-method process whose fd 2 is ``stderr_fd`` (a pipe's write end, in the
    parent) from the first line of Python it runs. The parent closes its own copy of
    ``stderr_fd`` after :meth:`start`."""

    def __init__(self, *args: Any, stderr_fd: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.stderr_fd = stderr_fd

    @staticmethod
    def _Popen(process_obj: Any) -> _PopenWithStderr:  # noqa: N802 - multiprocessing's name
        return _PopenWithStderr(process_obj)
