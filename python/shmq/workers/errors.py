"""The workers' errors: which worker died, how, and what it last wrote to stderr."""

from __future__ import annotations

import signal
from typing import Optional, Sequence

from .. import _core

__all__ = ["WorkerDiedError", "WorkersNotReadyError"]


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class WorkerDiedError(RuntimeError):
    """A worker process exited when it should not have: before it was ready, or with a
    non-zero exit code or a signal while it ran (a remote worker: it lost its connection).

    Attributes: ``name``, ``rank``, ``pid`` (None for a remote worker that never said),
    ``host`` (``""`` for a local worker), ``exitcode`` (as ``multiprocessing`` reports it:
    negative for a signal; None when unknown), ``signal_name`` (e.g. ``"SIGBUS"``, or
    None), ``stderr_tail`` (the last lines it wrote to stderr), ``before_ready``.
    """

    def __init__(
        self,
        name: str,
        rank: int,
        pid: Optional[int],
        exitcode: Optional[int],
        stderr_tail: Sequence[str] = (),
        *,
        host: str = "",
        before_ready: bool = False,
        how: Optional[str] = None,
        stderr_captured: bool = True,
        stderr_from_start: bool = True,
    ):
        self.name = name
        self.rank = rank
        self.pid = pid
        self.host = host
        self.exitcode = exitcode
        self.signal_name = _signal_name(-exitcode) if exitcode is not None and exitcode < 0 else None
        self.stderr_tail = list(stderr_tail)
        self.before_ready = before_ready
        # The wording is the core's (``crates/os/src/error.rs``), for Rust and Python alike.
        message = _core.worker_died_message(
            name,
            rank,
            pid,
            exitcode,
            self.stderr_tail,
            host,
            before_ready,
            how,
            stderr_captured,
            stderr_from_start,
        )
        super().__init__(message)

    def __reduce__(self) -> tuple:
        return (
            _rebuild_worker_died_error,
            (self.name, self.rank, self.pid, self.exitcode, self.stderr_tail, self.host, self.before_ready, str(self)),
        )


def _rebuild_worker_died_error(
    name: str,
    rank: int,
    pid: Optional[int],
    exitcode: Optional[int],
    tail: list[str],
    host: str,
    before_ready: bool,
    message: str,
) -> WorkerDiedError:
    """Unpickle a WorkerDiedError (its constructor takes more than the message)."""
    err = WorkerDiedError(name, rank, pid, exitcode, tail, host=host, before_ready=before_ready)
    err.args = (message,)
    return err


class WorkersNotReadyError(TimeoutError):
    """:meth:`WorkerProcesses.wait_until_ready` ran past its deadline. ``not_ready``: the
    names of the workers that had not called :func:`report_ready`."""

    def __init__(self, message: str, not_ready: Sequence[str]):
        super().__init__(message)
        self.not_ready = list(not_ready)
