"""The worker link's bounds in time and memory, on both ends (issue 54, item 3).

A worker (a spawned process calling ``connect_to_parent``) against a stranger posing as
its parent (a plain TCP server in this process):

- a stranger that drips its challenge, or its answer, a byte at a time cannot hold the
  worker past its ``timeout``: one deadline for the whole handshake, not one per read;
- a stranger that announces a 64 MiB challenge or answer is refused at the length, with
  a ``ConnectionError`` naming its address and the handshake's limit, and costs the
  worker no memory.

An admitted worker (this process, which joins with the ticket's token) flooding a real
parent (``_processes/worker_parent.py``, mode "remote", in a process of its own):

- frames over ``MAX_FRAME`` (10 x 60 MiB) are refused at the first one's length: the
  link ends, the parent reports the worker lost naming the limit, and its memory does
  not grow;
- frames up to ``MAX_FRAME`` (10 of them, of a kind the parent skips) cost the parent
  one frame's buffers at a time, and the link goes on.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
import time
from typing import Any, Optional

import pytest

from _processes import worker_targets as targets
import _link_by_hand as by_hand
from shmq import _core
from shmq.workers import WorkerTicket, protocol
from test_worker_port_hostile import STARTUP, _Parent

TIMEOUT = 3.0  # the worker's connect_to_parent(timeout=...)
# Slack for a busy machine to end the handshake after its deadline; far less than the
# stranger's drip lasts (what a per-read timeout let it have).
LATE = 5.0
DRIP_EVERY = 0.3  # seconds between the dripping stranger's bytes
DRIP_FOR = 20.0  # how long it drips at most (then it hangs up)
HUGE = 64 << 20  # what the strangers announce
MIB = 1 << 20


class _FakeParent:
    """A stranger on a ticket's address: a plain TCP server (a thread of this process)
    that takes one connection and, per ``mode``, drips a challenge ("drip-challenge"), or
    sends a genuine-looking challenge, reads the hello and drips an answer
    ("drip-answer"), or announces a 64 MiB challenge ("huge-challenge") or answer
    ("huge-answer") and then sends its bytes until the worker hangs up. ``sent``: the
    bytes of the dripped or announced frame it got out before the worker hung up."""

    def __init__(self, mode: str):
        self.mode = mode
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.ticket = WorkerTicket("127.0.0.1", self.port, "ab" * 32)
        self.sent = 0
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _frame(self, kind: bytes, payload: bytes) -> bytes:
        return struct.pack("!I", len(payload) + 1) + kind + payload

    def _run(self) -> None:
        try:
            self.server.settimeout(STARTUP)
            conn, _ = self.server.accept()
            with conn:
                conn.settimeout(STARTUP)
                challenge = self._frame(b"C", by_hand.challenge(_core.new_secret_text()))
                if self.mode.endswith("answer"):
                    conn.sendall(challenge)
                    by_hand.recv_frame(conn, protocol.MAX_HELLO_FRAME)
                if self.mode.startswith("drip"):
                    frame = challenge if self.mode == "drip-challenge" else self._frame(b"A", b" " * 200)
                    end = time.monotonic() + DRIP_FOR
                    for i in range(len(frame)):
                        if time.monotonic() > end:
                            break
                        conn.sendall(frame[i : i + 1])
                        self.sent += 1
                        time.sleep(DRIP_EVERY)
                else:
                    kind = b"C" if self.mode == "huge-challenge" else b"A"
                    conn.sendall(struct.pack("!I", HUGE) + kind)
                    chunk = bytes(1 << 16)
                    while self.sent < HUGE:
                        conn.sendall(chunk)
                        self.sent += len(chunk)
        except OSError as e:  # the worker hung up (as it should)
            self.error = e
        finally:
            self.server.close()

    def join(self) -> None:
        self.thread.join(STARTUP)
        assert not self.thread.is_alive()


def _worker_against(children: Any, stranger: _FakeParent) -> tuple[str, str, str, float, int]:
    out = children.queue()
    children.start(targets.joins_and_reports_how, out, str(stranger.ticket), 0, TIMEOUT)
    report = children.receive(out, timeout=DRIP_FOR + STARTUP)
    stranger.join()
    return report


@pytest.mark.parametrize("mode", ["drip-challenge", "drip-answer"])
def test_a_dripping_stranger_cannot_hold_connect_to_parent_past_its_timeout(children, mode):
    """Every read of the worker gets a byte well within ``timeout`` (a byte every 0.3 s,
    ``timeout`` 3 s); the handshake's one deadline ends it at 3 s with ``TimeoutError``
    (before: the timeout was per read, so the worker waited as long as the stranger
    dripped, 20 s here, for ever in general)."""
    stranger = _FakeParent(mode)
    how, error, message, took, _ = _worker_against(children, stranger)
    assert (how, error) == ("failed", "TimeoutError"), (how, error, message, took)
    assert f"127.0.0.1:{stranger.port}" in message and f"within {TIMEOUT:g} s" in message, message
    assert TIMEOUT - 0.5 <= took <= TIMEOUT + LATE, f"gave up after {took:.1f} s"
    assert stranger.sent < (TIMEOUT + LATE) / DRIP_EVERY + 2, stranger.sent


@pytest.mark.parametrize("mode", ["huge-challenge", "huge-answer"])
def test_a_huge_handshake_frame_is_refused_at_its_length(children, mode):
    """A stranger announcing a 64 MiB challenge (or answer) and sending it: the worker
    refuses the length before reading any of the body, with a ``ConnectionError`` that
    names the stranger's address and the handshake's limit, and hangs up (the stranger's
    send fails); its memory does not grow (before: it read all 64 MiB, its peak up by
    twice that, then failed on a "malformed challenge")."""
    stranger = _FakeParent(mode)
    how, error, message, took, peak_grown = _worker_against(children, stranger)
    assert (how, error) == ("failed", "ConnectionError"), (how, error, message)
    assert message.startswith(
        f"127.0.0.1:{stranger.port} sent a handshake frame of {HUGE} bytes, "
        f"over the handshake's limit of {protocol.MAX_HELLO_FRAME} bytes"
    ), message
    assert peak_grown < 4 * MIB, f"the worker's peak memory grew by {peak_grown / MIB:.1f} MiB"
    assert stranger.sent < HUGE and isinstance(stranger.error, OSError), (stranger.sent, stranger.error)


# ---------------------------------------------------------------------------------
# An admitted worker flooding its parent


def _join_as_worker(parent: _Parent) -> by_hand.SealedEnd:
    """Join ``parent`` as its remote rank 0 with the ticket's token, by hand (so that this
    process can then send what no ``connect_to_parent`` would)."""
    return by_hand.join(parent.ticket, 0, host="flooder", timeout=STARTUP)


def _send_sealed(link: by_hand.SealedEnd, kind: bytes, size: int) -> None:
    """A genuine sealed frame of ``kind`` with a ``size``-byte payload, whatever its size
    (``_core.Link.send`` refuses one over ``MAX_FRAME``)."""
    link.sock.sendall(link.sealed(kind, bytes(size)))


def test_an_admitted_worker_flooding_frames_over_the_limit_is_cut_off_at_the_first(children):
    """An admitted worker sends 10 sealed frames of 60 MiB: the parent refuses the first
    one's length (over ``MAX_FRAME``, 16 MiB) before reading its body, ends the link
    (the worker's sends fail) and reports the worker lost, naming the limit; its memory
    grows by less than 64 MiB at its peak (before: it read every frame, from 27 MiB to
    hundreds of MiB, much of it kept)."""
    parent = _Parent()
    frame = 60 * MIB
    try:
        rss, peak = parent.rss(), parent.peak_rss()
        link = _join_as_worker(parent)
        sent = 0
        try:
            for _ in range(10):
                _send_sealed(link, b"Z", frame)
                sent += 1
        except (ConnectionResetError, BrokenPipeError):
            pass  # the parent closed the link (a timeout would be its keeping it open, unread)
        died = parent.next_line(STARTUP)
        grown, peak_grown = parent.rss() - rss, parent.peak_rss() - peak
        link.sock.close()
    except BaseException:
        parent.kill()
        raise
    log = parent.finish()
    assert sent < 10, "every 60 MiB frame went through"
    assert "died" in died and f"over the link's limit of {protocol.MAX_FRAME} bytes" in died["died"], died
    assert f"sent a frame of {frame + 41} bytes" in died["died"], died
    assert peak_grown < 64 * MIB and grown < 64 * MIB, (
        f"the parent's memory grew by {grown / MIB:.0f} MiB (its peak by {peak_grown / MIB:.0f} MiB)"
    )
    assert "Traceback" not in log, log


def test_an_admitted_worker_flooding_frames_up_to_the_limit_costs_one_frame_at_a_time(children):
    """An admitted worker sends 10 sealed frames of ``MAX_FRAME`` bytes of a kind the
    parent skips, then its ready report: the parent reads each as it comes, holding one
    at a time, and its peak memory grows by less than 64 MiB (about twice a frame); what
    it keeps afterwards is bounded too, and the worker is admitted as ready."""
    parent = _Parent()
    try:
        rss, peak = parent.rss(), parent.peak_rss()
        link = _join_as_worker(parent)
        for _ in range(10):
            _send_sealed(link, b"Z", protocol.MAX_FRAME - 1 - 40)
        link.send(b"R", pickle.dumps({"rank": 0, "pid": os.getpid(), "where": "remote"}))
        ready = parent.next_line(STARTUP)
        grown, peak_grown = parent.rss() - rss, parent.peak_rss() - peak
        # The parent's close() tells this worker to stop; it leaves.
        finisher = threading.Thread(target=parent.finish, daemon=True)
        finisher.start()
        kind, _ = link.recv()
        assert kind == b"S", kind
        link.send(b"X", b'{"exitcode": 0, "stderr": []}')
        finisher.join(STARTUP)
        link.sock.close()
    except BaseException:
        parent.kill()
        raise
    assert ready == {"ready": [{"rank": 0, "pid": os.getpid(), "where": "remote"}]}, ready
    assert peak_grown < 64 * MIB and grown < 64 * MIB, (
        f"the parent's memory grew by {grown / MIB:.0f} MiB (its peak by {peak_grown / MIB:.0f} MiB)"
    )
    assert parent.proc.returncode == 0, "\n".join(parent.log)
