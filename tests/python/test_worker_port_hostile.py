"""Strangers on a ``WorkerProcesses`` parent's port, before any authentication (issue 44).

Each test runs a real parent (``_processes/worker_parent.py``, mode "remote": one remote rank,
listening on 127.0.0.1) in a process of its own, attacks its port from this process with
plain TCP connections that know no token, and then has a genuine remote worker (a spawned
process calling ``connect_to_parent``) join it:

- connections that send a byte now and then are dropped at the handshake's deadline
  (one for the whole handshake, not one per read);
- more of them than there are handshake slots do not keep the genuine worker out;
- a frame header announcing 64 MiB costs the parent no memory (the frame is refused
  before its body is read);
- a malformed hello (nested 200,000 deep, or deeper than the parser's recursion limit
  within the frame limit, not UTF-8, of the wrong types) is refused with one line in the
  log, never a traceback;
- running out of descriptors (``EMFILE``) in ``accept`` does not end the parent's accept
  thread.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import psutil

import _processes
from _processes import worker_targets as targets
import _link_by_hand as by_hand
from shmq import _core
from shmq.workers import WorkerTicket, protocol

HERE = Path(__file__).resolve().parent
STARTUP = 60.0  # bounds on what only needs to finish (spawned interpreters, a busy machine)
DEADLINE = protocol.HANDSHAKE_TIMEOUT  # the parent's deadline for a whole handshake (10 s)
# How long a genuine worker may take to be admitted past the strangers: half the deadline,
# so it cannot have got in by waiting for a stranger's deadline to free a slot.
ADMITTED_WITHIN = DEADLINE / 2
# Slack for the parent to act on a deadline and this process to see it (a busy machine):
# far less than what a per-read timeout lets a dripping stranger have (for ever).
LATE = 5.0
SLOTS = 32  # the parent's handshakes in progress at once (protocol.MAX_HANDSHAKES, the core's)
HELLO_LIMIT = 4096  # the largest frame before the token is proved (protocol.MAX_HELLO_FRAME)


class _Parent:
    """A ``WorkerProcesses`` parent in a process of its own; threads collect its stdout's
    JSON lines and its stderr's lines (its log)."""

    def __init__(self, free_fds: Optional[int] = None):
        args = [sys.executable, str(HERE / "_processes" / "worker_parent.py"), "0", "spawn", "remote"]
        if free_fds is not None:
            args.append(str(free_fds))
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),  # it imports _processes
        )
        self._lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self._lines.put), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.log.append), daemon=True),
        ]
        for t in self._readers:
            t.start()
        first = self.next_line(STARTUP)
        self.pid: int = first["parent"]
        assert self.pid == self.proc.pid
        self.ticket = WorkerTicket.parse(first["ticket"])
        self.address = (self.ticket.host, self.ticket.port)
        self.free_fds: Optional[int] = first["free_fds"]
        self.process = psutil.Process(self.pid)

    @staticmethod
    def _read(stream: Any, put: Any) -> None:
        for line in stream:
            put(line.rstrip("\n"))

    def next_line(self, timeout: float) -> dict:
        """The parent's next stdout line, as JSON."""
        try:
            return json.loads(self._lines.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(
                f"the parent said nothing within {timeout} s; its log:\n" + "\n".join(self.log)
            ) from None

    def logged(self, text: str) -> list[str]:
        return [line for line in list(self.log) if text in line]

    def rss(self) -> int:
        return self.process.memory_info().rss

    def peak_rss(self) -> int:
        """The kernel's high-water mark of the parent's resident memory (VmHWM)."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")

    def finish(self) -> str:
        """Let the parent close its group and exit (it waits for its stdin's end once
        every worker is ready), and wait for that; its whole log."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=STARTUP)
        finally:
            self.kill()
        assert self.proc.returncode == 0, "\n".join(self.log)
        return "\n".join(self.log)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=STARTUP)
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        for t in self._readers:
            t.join(STARTUP)


class _Strangers:
    """``n`` connections to the parent's port that know no token. A thread reads (and
    drops) what the parent says on each, and records when the parent hung up:
    ``closed_after[i]``, seconds from connection ``i``'s connect. With ``drip``, each
    sends the next byte of what would be a 1000-byte hello every ``drip`` seconds: every
    read of the parent gets a byte well within any per-read timeout."""

    FRAME = struct.pack("!I", 1000) + b"H" + b" " * 999

    def __init__(self, address: tuple[str, int], n: int, drip: Optional[float] = None):
        self.socks: list[socket.socket] = []
        self.opened: list[float] = []
        for _ in range(n):
            s = socket.create_connection(address, timeout=STARTUP)
            s.setblocking(False)
            self.socks.append(s)
            self.opened.append(time.monotonic())
        self.heard: set[int] = set()  # the parent said something (its challenge)
        self.closed_after: dict[int, float] = {}
        self._drip = drip
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _hung_up(self, i: int) -> None:
        self.closed_after.setdefault(i, time.monotonic() - self.opened[i])

    def _run(self) -> None:
        sent = 0
        next_drip = time.monotonic() + (self._drip or 0.0)
        while not self._stop.wait(0.01):  # polling the sockets: 10 ms resolution
            for i, s in enumerate(self.socks):
                if i in self.closed_after:
                    continue
                try:
                    while True:
                        data = s.recv(65536)
                        if not data:
                            self._hung_up(i)
                            break
                        self.heard.add(i)
                except BlockingIOError:
                    pass
                except OSError:  # reset
                    self._hung_up(i)
            if self._drip and time.monotonic() >= next_drip and sent < len(self.FRAME):
                for i, s in enumerate(self.socks):
                    if i not in self.closed_after:
                        try:
                            s.send(self.FRAME[sent : sent + 1])
                        except OSError:
                            self._hung_up(i)
                sent += 1
                next_drip += self._drip

    def answered(self) -> bool:
        """Whether the parent took every connection: it sent each its challenge, or
        closed it."""
        return all(i in self.heard or i in self.closed_after for i in range(len(self.socks)))

    def open_count(self) -> int:
        return len(self.socks) - len(self.closed_after)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(STARTUP)
        for s in self.socks:
            s.close()


def _genuine_worker_joins(children: Any, parent: _Parent, within: float) -> tuple[Any, Any, float]:
    """Start a genuine remote worker (rank 0, ``connect_to_parent``), let it join once it
    is running, and wait for the parent to say every worker is ready: (the worker's
    report queue, its process, the seconds from its go to the parent's ready report)."""
    out, go = children.queue(), children.event()
    remote = children.start(targets.remote_worker, out, str(parent.ticket), 0, False, go)
    _, remote_pid = children.expect(out, "pid", timeout=STARTUP)
    start = time.monotonic()
    go.set()
    try:
        ready = parent.next_line(within)
    except AssertionError as e:
        # What the worker met, if it gave up already.
        try:
            report = out.get(timeout=0.1)
        except queue.Empty:
            report = None
        raise AssertionError(f"{e}\nthe worker's report: {report}") from None
    took = time.monotonic() - start
    assert ready == {"ready": [{"rank": 0, "pid": remote_pid, "where": "remote"}]}
    children.expect(out, "ready")
    return out, remote, took


def _worker_stopped_by_the_parent(out: Any, remote: Any) -> None:
    """The parent's close() stopped the worker: SIGTERM, a SystemExit(143) in its main
    thread, which the harness reports as an error."""
    report = out.get(timeout=STARTUP)
    assert report[0] == "error" and f"SystemExit: {128 + signal.SIGTERM}" in report[2], report
    remote.join(STARTUP)


# ---------------------------------------------------------------------------------
# (a) One deadline for the whole handshake


def test_a_stranger_dripping_bytes_is_dropped_at_the_handshake_deadline():
    """A byte a second keeps every read of the handshake within a per-read timeout; the
    parent's deadline is for the whole handshake, so it drops the connection at 10 s."""
    parent = _Parent()
    strangers = _Strangers(parent.address, 3, drip=1.0)
    try:
        _processes.wait_for(lambda: strangers.open_count() == 0, DEADLINE + 2 * LATE, "the strangers' end")
        for i, after in strangers.closed_after.items():
            assert DEADLINE - 0.5 <= after <= DEADLINE + LATE, f"stranger {i} dropped after {after:.2f} s"
    finally:
        strangers.close()
        parent.kill()
    assert len(parent.logged(f"failed: not done within {DEADLINE:.0f} s")) == 3, "\n".join(parent.log)


# ---------------------------------------------------------------------------------
# (c) More strangers than slots do not keep a genuine worker out


def test_slow_strangers_in_every_slot_do_not_keep_a_genuine_worker_out(children):
    """40 connections dripping bytes (more than the parent's 32 handshake slots) hold the
    port first; a genuine worker joining then is admitted at once (the oldest waiting
    stranger gives way), not after the strangers' deadline, and the strangers left are
    dropped at their deadline."""
    parent = _Parent()
    try:
        strangers = _Strangers(parent.address, 40, drip=1.0)
        try:
            _processes.wait_for(strangers.answered, STARTUP, "the parent to take every stranger")
            out, remote, took = _genuine_worker_joins(children, parent, ADMITTED_WITHIN)
            # In while the strangers still held the other slots (none had reached its
            # deadline): 40 - 8 dropped for newer strangers - 1 for the worker.
            assert strangers.open_count() >= SLOTS - 2, strangers.closed_after
            assert took < ADMITTED_WITHIN
            _processes.wait_for(lambda: strangers.open_count() == 0, DEADLINE + 2 * LATE, "the strangers' end")
            assert max(strangers.closed_after.values()) <= DEADLINE + LATE, strangers.closed_after
        finally:
            strangers.close()
    except BaseException:
        parent.kill()
        raise
    log = parent.finish()
    _worker_stopped_by_the_parent(out, remote)
    assert len(parent.logged("dropped the oldest waiting one")) == 9, log
    assert "Traceback" not in log


# ---------------------------------------------------------------------------------
# (b) Frames before authentication are small


def test_strangers_announcing_64_mib_frames_cost_the_parent_no_memory():
    """16 connections each send a header announcing a 64 MiB hello and then the 64 MiB:
    the parent refuses the length before it reads any of it and hangs up (the sender sees
    the connection reset), and its memory does not grow (before, it read every byte:
    hundreds of MiB at its peak, much of it kept)."""
    parent = _Parent()
    size = 64 << 20  # four times the largest frame even an admitted link takes (MAX_FRAME)
    body = memoryview(bytes(size))
    got: list[Optional[str]] = [None] * 16

    def stranger(i: int) -> None:
        with socket.create_connection(parent.address, timeout=STARTUP) as s:
            try:
                s.sendall(struct.pack("!I", size) + b"H")
                s.sendall(body[1:])
                got[i] = "sent it all"
            except OSError as e:
                got[i] = type(e).__name__

    try:
        rss, peak = parent.rss(), parent.peak_rss()
        threads = [threading.Thread(target=stranger, args=(i,), daemon=True) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(STARTUP)
        grown, peak_grown = parent.rss() - rss, parent.peak_rss() - peak
        # Each refusal is logged; a stranger may see its reset before the parent's line
        # about it has come through the log pipe: wait for the lines (bounded) before
        # the parent goes.
        refused = "sent a handshake frame of 67108864 bytes, over the handshake's limit of 4096 bytes"
        deadline = time.monotonic() + STARTUP
        while len(parent.logged(refused)) < 16 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        parent.kill()
    assert grown < 4 << 20 and peak_grown < 4 << 20, (
        f"the parent's memory grew by {grown >> 20} MiB (its peak by {peak_grown >> 20} MiB)"
    )
    assert set(got) <= {"ConnectionResetError", "BrokenPipeError"}, got
    assert len(parent.logged(refused)) == 16, "\n".join(parent.log)


# ---------------------------------------------------------------------------------
# (e) A malformed hello: one line in the log, never a traceback


def _hello_with(**fields: Any) -> bytes:
    hello = {"rank": 0, "pid": 1, "host": "here", "nonce": _core.new_secret_text(), "mac": "00" * 32}
    hello.update(fields)
    return json.dumps(hello).encode()


BAD_HELLOS = {
    "nested 200,000 deep": (b"H", b"[" * 200_000),
    "nested deeper than the parser goes, within the frame limit": (b"H", b"[" * (HELLO_LIMIT - 1)),
    "objects nested deeper than the parser goes": (b"H", b'{"":[' * 800),
    "not UTF-8": (b"H", b"\x80\x81\x82\x83\xff"),
    "a list": (b"H", b"[1, 2]"),
    "fields of the wrong types": (b"H", _hello_with(rank=[0], pid="1", host=7, nonce={}, mac=None)),
    "a rank of 3000 digits": (b"H", _hello_with(rank=10**3000)),
    "a rank past 32 bits": (b"H", _hello_with(rank=2**40)),
    "not a hello": (b"X", b"{}"),
}


def test_malformed_hellos_are_refused_in_one_line_and_the_parent_serves_on(children):
    """Each malformed hello is refused (an "A" refusal, or none) and its connection
    closed at once, with one line in the parent's log and no traceback (before: a
    ``RecursionError`` traceback, and the connection kept); a genuine worker joins
    afterwards."""
    parent = _Parent()
    try:
        for what, (kind, payload) in BAD_HELLOS.items():
            with socket.create_connection(parent.address, timeout=STARTUP) as s:
                assert by_hand.recv_frame(s)[0] == b"C"
                s.settimeout(DEADLINE / 2)  # it hangs up at once
                try:
                    by_hand.send_frame(s, kind, payload)
                    # A refusal ("A", not ok) or none; then the parent hangs up.
                    while s.recv(65536):
                        pass
                except (ConnectionResetError, BrokenPipeError):
                    pass  # hung up before it read it all
                except TimeoutError:
                    log = "\n".join(parent.log)
                    raise AssertionError(f"the parent kept a connection that sent {what}; its log:\n{log}") from None
        out, remote, _ = _genuine_worker_joins(children, parent, STARTUP)
    except BaseException:
        parent.kill()
        raise
    log = parent.finish()
    _worker_stopped_by_the_parent(out, remote)
    assert "Traceback" not in log and "Exception in thread" not in log, log
    refusals = [line for line in parent.log if "worker handshake with" in line or "refused a worker" in line]
    assert len(refusals) == len(BAD_HELLOS), log
    if sys.version_info < (3, 12):  # later Pythons' parsers may go deeper than 4 KiB
        assert len(parent.logged("a hello nested too deep")) == 2, log
    assert len(parent.logged("sent a handshake frame of 200001 bytes, over the handshake's limit of 4096")) == 1, log


# ---------------------------------------------------------------------------------
# (d) The accept loop survives EMFILE


def _became(cond: Any, timeout: float) -> bool:
    """Whether ``cond()`` held within ``timeout`` seconds (``wait_for``, without failing)."""
    try:
        _processes.wait_for(cond, timeout)
    except AssertionError:
        return False
    return True


def test_the_port_accepts_again_after_the_parent_ran_out_of_descriptors(children):
    """The parent's RLIMIT_NOFILE leaves it 4 descriptors; 6 silent strangers take them
    (and wait in the backlog), so its accept fails with EMFILE (accept(2) takes a
    descriptor before it waits for a connection). Once the strangers hang up, a genuine
    worker is admitted: the accept thread paused and went on (before: it ended)."""
    parent = _Parent(free_fds=4)
    try:
        fds = parent.process.num_fds()
        strangers = _Strangers(parent.address, 6)
        try:
            _processes.wait_for(
                lambda: parent.process.num_fds() == fds + 4, STARTUP, "the strangers to take every descriptor"
            )
            # Not asserted here (the admission below is what matters): the parent's log
            # line that accept failed, which only a surviving accept thread writes.
            said_emfile = _became(lambda: parent.logged("Too many open files"), DEADLINE / 2)
        finally:
            strangers.close()
        out, remote, _ = _genuine_worker_joins(children, parent, DEADLINE)
    except BaseException:
        parent.kill()
        raise
    log = parent.finish()
    _worker_stopped_by_the_parent(out, remote)
    assert said_emfile
    # Said once, however many times accept failed; and that it accepts again.
    assert len(parent.logged("cannot accept now (Too many open files)")) == 1, log
    assert len(parent.logged("accepts again")) == 1, log
    assert "Traceback" not in log
