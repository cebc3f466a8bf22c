"""The harness: runs the roles of one scenario run in child processes (spawn), each
wait bounded, and collects what they return."""

from __future__ import annotations

import os
import queue
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from .common import BenchError
from .roles import _child_main, _stack_file
from .transports import Transport

#: Seconds a child that has reported may take to exit, beyond the run's timeout.
EXIT_GRACE = 10.0


@dataclass
class Job:
    """One child process of a run: ``role(transport, channels, barrier, **kwargs)``."""

    role: Callable
    channels: Sequence[Any]
    kwargs: dict = field(default_factory=dict)


class Harness:
    """Starts the processes of one run and collects what their roles return.

    A run fails (``BenchError``) when a child raises, exits without reporting, or the
    whole run takes longer than ``timeout`` seconds (the error then carries the stuck
    children's Python stacks and kernel wait channels); its children are then
    terminated (killed if they do not stop) and shmq segments they created are removed.
    """

    def __init__(self, ctx: Any, workdir: str, timeout: float):
        self.ctx = ctx
        self.workdir = workdir
        self.timeout = timeout

    def channel(self, transport: Transport, n_readers: int) -> Any:
        return transport.make_channel(self.ctx, n_readers, self.workdir)

    def run(self, transport: Transport, jobs: Sequence[Job], timeout: Optional[float] = None) -> list[Any]:
        """Run ``jobs`` at once, one process each; returns their values in job order.
        ``timeout`` (default: the harness's) bounds the whole run."""
        timeout = self.timeout if timeout is None else timeout
        barrier = self.ctx.Barrier(len(jobs))
        results = self.ctx.Queue()
        procs = [
            self.ctx.Process(
                target=_child_main,
                args=(i, job.role, transport, job.channels, barrier, results, job.kwargs, self.workdir),
                name=f"shmq-bench-{job.role.__name__.lstrip('_')}-{i}",
                daemon=True,
            )
            for i, job in enumerate(jobs)
        ]
        values: dict[int, Any] = {}
        ok = False
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            while len(values) < len(procs):
                try:
                    index, success, value, details = results.get(timeout=0.2)
                except queue.Empty:
                    self._check_alive(procs, values, deadline, timeout)
                    continue
                if not success:
                    raise self._first_cause(procs, results, index, value, details)
                values[index] = value
            for p in procs:
                # It has reported: give its exit (the transport's teardown) a moment even
                # when the run's time is nearly spent.
                p.join(max(EXIT_GRACE, deadline - time.monotonic()))
                if p.exitcode is None:
                    raise BenchError(f"{p.name} did not exit within {EXIT_GRACE:g} s after reporting")
                if p.exitcode != 0:
                    raise BenchError(f"{p.name} exited with code {p.exitcode} after reporting")
            ok = True
        finally:
            if not ok:
                self._stop(procs)
            results.close()
            results.join_thread()
        return [values[i] for i in range(len(procs))]

    @staticmethod
    def _first_cause(procs: list, results: Any, index: int, message: str, details: str) -> BenchError:
        """The error to report once a child failed: the failing child aborts the
        barrier, so the others fail too, with ``BrokenBarrierError``; give them a moment
        to report and prefer an error that is not that."""
        errors = [(index, message, details)]
        try:
            while True:
                i, success, value, more = results.get(timeout=0.5)
                if not success:
                    errors.append((i, value, more))
        except queue.Empty:
            pass
        causes = [e for e in errors if not e[1].startswith("BrokenBarrierError")] or errors
        i, message, details = causes[0]
        return BenchError(f"{procs[i].name}: {message}", details)

    def _check_alive(self, procs: list, values: dict, deadline: float, timeout: float) -> None:
        for i, p in enumerate(procs):
            if i not in values and p.exitcode not in (None, 0):
                raise BenchError(f"{p.name} exited with code {p.exitcode} without reporting")
        if time.monotonic() > deadline:
            waiting = [p for i, p in enumerate(procs) if i not in values]
            names = ", ".join(p.name for p in waiting)
            raise BenchError(f"timed out after {timeout:g} s waiting for {names}", self._stacks(waiting))

    def _stacks(self, procs: list) -> str:
        """Where ``procs`` are stuck: their Python stacks, asked for with SIGUSR1."""
        for p in procs:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except (OSError, TypeError):
                pass
        time.sleep(0.5)
        dumps = []
        for p in procs:
            try:
                with open(f"/proc/{p.pid}/wchan") as f:
                    wchan = f.read().strip()
                wchan = wchan if wchan not in ("", "0") else "running"
            except OSError:
                wchan = "?"
            try:
                with open(_stack_file(self.workdir, p.pid)) as f:
                    stack = f.read().rstrip()
            except OSError:
                stack = "(no stack)"
            dumps.append(f"{p.name} (pid {p.pid}, kernel wait channel: {wchan}):\n{stack}")
        return "\n".join(dumps)

    @staticmethod
    def _stop(procs: list) -> None:
        """Terminate, then kill, every child still running; remove the segments of the
        shmq queues they created (the creator removes them on a clean exit only)."""
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            if p.pid is None:
                continue
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        _remove_segments_of({p.pid for p in procs if p.pid is not None})


def _remove_segments_of(pids: set[int]) -> None:
    """Unlink the shmq segments in ``SHM_DIR`` whose creator is one of ``pids`` (killed
    children cannot remove their own)."""
    try:
        from shmq import _core
    except ImportError:
        return
    for name, _size, _kind, creator, _alive in _core.list_segments():
        if creator in pids:
            try:
                os.unlink(os.path.join(_core.SHM_DIR, name))
            except OSError:
                pass
