"""The workers' errors: which worker died, how, and what it last wrote to stderr."""

from __future__ import annotations

import signal
from typing import Optional, Sequence

__all__ = ["WorkerDiedError", "WorkersNotReadyError"]


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _describe_exit(exitcode: Optional[int]) -> str:
    """``exitcode`` in words, as ``multiprocessing`` reports it (negative: the signal that
    killed the process): "exited with code 1", "was killed by SIGBUS"."""
    if exitcode is None:
        return "exited (exit code unknown)"
    if exitcode < 0:
        return f"was killed by {_signal_name(-exitcode)}"
    if exitcode > 128 and exitcode - 128 < signal.NSIG:
        # The bootstrap turns SIGTERM into SystemExit(128 + SIGTERM), as shells report it.
        return f"exited with code {exitcode} (128 + {_signal_name(exitcode - 128)}: it was asked to stop)"
    return f"exited with code {exitcode}"


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
        where = f"rank {rank}, pid {pid}" if pid is not None else f"rank {rank}"
        if host:
            where += f" on {host}"
        when = "before it was ready" if before_ready else "while it was running"
        message = f"{name} ({where}) {how or _describe_exit(exitcode)} {when}"
        if self.stderr_tail:
            message += "; the last lines of its stderr:\n" + "\n".join(f"    {line}" for line in self.stderr_tail)
        elif stderr_captured and not host:
            if stderr_from_start:
                message += " (it wrote nothing to stderr)"
            else:
                # Its stderr was captured from shmq's bootstrap on (start methods other than
                # spawn): what it wrote while it started went to the stderr it inherited.
                message += (
                    " (it wrote nothing to stderr after shmq's bootstrap took it over; what it wrote"
                    " while starting, e.g. while re-importing the main module, went to the parent's stderr)"
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
