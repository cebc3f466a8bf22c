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

#: Seconds a child that has reported may take to exit.
EXIT_GRACE = 10.0
#: Seconds a run may go without progress (no child beat: no message, barrier or start,
#: :func:`~shmq_bench.roles.beat`) before it fails: the one bound on a run.
STALL_S = 10.0


@dataclass
class Job:
    """One child process of a run: ``role(transport, channels, barrier, **kwargs)``."""

    role: Callable
    channels: Sequence[Any]
    kwargs: dict = field(default_factory=dict)


class Harness:
    """Starts the processes of one run and collects what their roles return.

    A run fails (``BenchError``) when a child raises, exits without reporting, or none
    of its children makes progress for ``stall`` seconds (each beats a counter in
    shared memory as its messages go: :func:`~shmq_bench.roles.beat`; the error then
    carries the stuck children's Python stacks and kernel wait channels); its children
    are then terminated (killed if they do not stop) and shmq segments they created are
    removed. A run that makes progress is never cut short: one that takes longer than
    ``timeout`` seconds (what it takes on a quiet machine, with room to spare) is noted
    as slow (:meth:`take_notes`) and its figures are kept.
    """

    def __init__(self, ctx: Any, workdir: str, timeout: float, stall: float = STALL_S):
        self.ctx = ctx
        self.workdir = workdir
        self.timeout = timeout
        self.stall = stall
        self._notes: list[str] = []

    def take_notes(self) -> list[str]:
        """The notes of the runs since the last call (a slow run's time), and forget them."""
        notes, self._notes = self._notes, []
        return notes

    def channel(self, transport: Transport, n_readers: int) -> Any:
        return transport.make_channel(self.ctx, n_readers, self.workdir)

    def run(self, transport: Transport, jobs: Sequence[Job], timeout: Optional[float] = None) -> list[Any]:
        """Run ``jobs`` at once, one process each; returns their values in job order.
        ``timeout`` (default: the harness's): past it, the run is noted as slow."""
        timeout = self.timeout if timeout is None else timeout
        barrier = self.ctx.Barrier(len(jobs))
        results = self.ctx.Queue()
        beats = self.ctx.RawArray("Q", len(jobs))
        procs = [
            self.ctx.Process(
                target=_child_main,
                args=(i, job.role, transport, job.channels, barrier, results, job.kwargs, self.workdir, beats),
                name=f"shmq-bench-{job.role.__name__.lstrip('_')}-{i}",
                daemon=True,
            )
            for i, job in enumerate(jobs)
        ]
        values: dict[int, Any] = {}
        ok = False
        try:
            started = time.monotonic()
            for p in procs:
                p.start()
            watchdog = _Watchdog(beats, self.stall)
            while len(values) < len(procs):
                try:
                    index, success, value, details = results.get(timeout=0.2)
                except queue.Empty:
                    self._check_alive(procs, values, watchdog)
                    continue
                if not success:
                    raise self._first_cause(procs, results, index, value, details)
                values[index] = value
            took = time.monotonic() - started
            if took > timeout:
                self._notes.append(
                    f"slow: a run took {took:.1f} s (over the {timeout:g} s it takes with room to spare on a quiet "
                    "machine); figures kept"
                )
            for p in procs:
                # It has reported: give its exit (the transport's teardown) a moment.
                p.join(EXIT_GRACE)
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

    def _check_alive(self, procs: list, values: dict, watchdog: "_Watchdog") -> None:
        for i, p in enumerate(procs):
            if i not in values and p.exitcode not in (None, 0):
                raise BenchError(f"{p.name} exited with code {p.exitcode} without reporting")
        if watchdog.stalled():
            waiting = [p for i, p in enumerate(procs) if i not in values]
            names = ", ".join(p.name for p in waiting)
            raise BenchError(
                f"no progress for {watchdog.stall:g} s (no message, barrier or start in any process of the run) "
                f"waiting for {names}",
                self._stacks(waiting),
            )

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


class _Watchdog:
    """Whether a run has stalled: none of its children's beat counters (``beats``, a
    shared array the children add to) has moved for ``stall`` seconds."""

    def __init__(self, beats: Any, stall: float):
        self.beats, self.stall = beats, stall
        self.seen = list(beats)
        self.moved = time.monotonic()

    def stalled(self) -> bool:
        now, counts = time.monotonic(), list(self.beats)
        if counts != self.seen:
            self.seen, self.moved = counts, now
        return now - self.moved > self.stall


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
