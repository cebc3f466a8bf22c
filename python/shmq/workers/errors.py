"""The workers' errors: which worker died, how, and what it last wrote to stderr."""

from __future__ import annotations

import json
import signal
from typing import Any, Optional, Sequence

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


def failure_notice(error: WorkerDiedError, limit: int) -> bytes:
    """``error`` as the parent tells it to the other workers (see ``sibling_failure``):
    JSON of its attributes and message, at most ``limit`` bytes (the oldest stderr lines
    are left out first, then the message is cut)."""
    tail = list(error.stderr_tail)
    message = str(error)
    while True:
        fields: dict[str, Any] = {
            "name": error.name,
            "rank": error.rank,
            "pid": error.pid,
            "exitcode": error.exitcode,
            "host": error.host,
            "before_ready": error.before_ready,
            "stderr_tail": tail,
            "message": message,
        }
        payload = json.dumps(fields).encode()
        if len(payload) <= limit:
            return payload
        if tail:
            tail.pop(0)
        else:
            message = message[: max(0, len(message) - (len(payload) - limit) - 1)]


def failure_from_notice(payload: bytes) -> Optional[WorkerDiedError]:
    """The error a :func:`failure_notice` carries; None for one that is not (the worker
    trusts its parent, but never with more than plain fields)."""
    try:
        f = json.loads(payload)
        name, rank, pid, exitcode = str(f["name"]), int(f["rank"]), f["pid"], f["exitcode"]
        tail = [str(line) for line in f["stderr_tail"]]
        return _rebuild_worker_died_error(
            name,
            rank,
            None if pid is None else int(pid),
            None if exitcode is None else int(exitcode),
            tail,
            str(f["host"]),
            bool(f["before_ready"]),
            str(f["message"]),
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


class WorkersNotReadyError(TimeoutError):
    """:meth:`WorkerProcesses.wait_until_ready` ran past its deadline. ``not_ready``: the
    names of the workers that had not called :func:`report_ready`."""

    def __init__(self, message: str, not_ready: Sequence[str]):
        super().__init__(message)
        self.not_ready = list(not_ready)
