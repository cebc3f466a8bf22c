"""What both sides share: the ticket a remote worker joins with, and the link's protocol.

The link is an authenticated stream built as the queue's remote stream is (the core's
``auth``: one secret, one MAC, one seal): a handshake in which each side proves it knows
the ticket's token over the other's fresh nonce, then every frame sealed with the core's
message MAC. Only the transport is the link's own: one TCP connection, whose loss is the
worker's death (the stream is ZeroMQ with credit).

Frames are ``[4-byte big-endian length][1-byte kind][payload]``; after the handshake the
payload starts with the frame's 8-byte sequence number and its 32-byte seal::

    parent -> worker   C  {"nonce": hex, "version": 2}              challenge (32 bytes)
    worker -> parent   H  {"rank", "pid", "host", "nonce", "mac"}   mac: hello_mac()
    parent -> worker   A  {"ok": true, "mac"}                       mac: welcome_mac()
                       A  {"ok": false, "error": str}               refused, then closed
      -- sealed from here: SealedLink --
    worker -> parent   R  pickle(info)                              ready
    worker -> parent   X  {"exitcode", "stderr": [lines]}           leaving
    parent -> worker   S  {"grace": seconds}                        stop
    parent -> worker   F  {"name", "rank", "pid", "exitcode", ...}  a sibling failed

The token never crosses the network (only MACs over fresh nonces), so a recorded
handshake cannot be replayed, and a process that does not know the token can pass for
neither side. The session of the sealed frames is both nonces: a frame from another
connection, altered, replayed or out of turn (one before it lost) fails its check and
ends the link; a last frame lost with the connection is the connection's loss. The parent
unpickles only sealed frames from an admitted worker; the worker unpickles nothing.
``version`` (2: this protocol) lets a worker tell a parent of an older shmq from one
that refuses it.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from .. import _core

__all__ = ["DEFAULT_GRACE", "WorkerTicket"]

DEFAULT_GRACE = 5.0
"""Seconds a shutdown waits after SIGTERM before it sends SIGKILL."""

HANDSHAKE_TIMEOUT = 10.0
"""Seconds the parent gives one connection for its whole handshake, from its accept to the
parent's answer (every read and write of it together, not each read)."""
PROTOCOL_VERSION = 2
"""The link's protocol, in the parent's challenge (an older shmq's had none)."""
MAX_FRAME = 64 << 20
"""The largest frame of an admitted link."""
MAX_HELLO_FRAME = 4096
"""The largest frame the parent reads before the peer proved the token: the hello (about
300 bytes; its longest field is the host name, at most 255 bytes before JSON's escapes).
A larger length is refused before anything more is read."""
_RECV_CHUNK = 64 << 10  # the most one recv asks for (CPython allocates what is asked)


@dataclass(frozen=True)
class WorkerTicket:
    """What a worker on another machine needs to join: the parent's address and a random
    token (the secret that authenticates it; send it over a trusted channel).

    ``str(ticket)`` is ``shmq-workers://HOST:PORT/TOKEN`` (an IPv6 host in brackets);
    :meth:`parse` reads it back, so a ticket can travel as a command-line argument or an
    environment variable."""

    host: str
    port: int
    token: str = field(repr=False)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"shmq-workers://{host}:{self.port}/{self.token}"

    @classmethod
    def parse(cls, text: str) -> "WorkerTicket":
        """The ticket ``str(ticket)`` printed."""
        prefix = "shmq-workers://"
        if not text.startswith(prefix):
            raise ValueError(f"not a worker ticket (expected {prefix}HOST:PORT/TOKEN): {text[:40]!r}")
        address, _, token = text[len(prefix) :].partition("/")
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not is_secret_text(token):
            raise ValueError(
                f"not a worker ticket (expected {prefix}HOST:PORT/TOKEN, TOKEN 64 hexadecimal digits): {text[:40]!r}"
            )
        return cls(host.strip("[]"), int(port), token)


def send_frame(sock: socket.socket, kind: bytes, payload: bytes) -> None:
    sock.sendall(struct.pack("!I", len(payload) + 1) + kind + payload)


def recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytes:
    """``n`` bytes, read as they come (each read asks for at most 64 KiB). With
    ``deadline`` (a ``time.monotonic()`` time), every read waits only for what is left of
    it, and ``TimeoutError`` comes once it passed: a peer that sends a byte now and then
    cannot stretch the whole read past it."""
    chunks = []
    while n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the deadline passed")
            sock.settimeout(left)
        chunk = sock.recv(min(n, _RECV_CHUNK))  # TimeoutError at the deadline
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_frame(
    sock: socket.socket, max_length: int = MAX_FRAME, deadline: Optional[float] = None
) -> tuple[bytes, bytes]:
    """One frame's kind and payload. A length over ``max_length`` raises ``ValueError``
    before the frame's body is read; ``deadline``: see :func:`recv_exact`."""
    (length,) = struct.unpack("!I", recv_exact(sock, 4, deadline))
    if not 1 <= length <= max_length:
        raise ValueError(f"bad frame length {length} (at most {max_length} here)")
    data = recv_exact(sock, length, deadline)
    return data[:1], data[1:]


def is_secret_text(text: str) -> bool:
    """Whether ``text`` is 32 bytes in a secret's one text form (the core's
    ``secret_from_text``): a ticket's token, a handshake nonce."""
    try:
        _core.secret_from_text(text)
    except ValueError:
        return False
    return True


def new_nonce() -> str:
    """A fresh nonce for the handshake: 32 random bytes from the kernel, in the same text
    form."""
    return _core.new_secret_text()


def _hello_parts(parent_nonce: str, rank: int, pid: int, host: str, worker_nonce: str) -> list[bytes]:
    return [parent_nonce.encode(), str(rank).encode(), str(pid).encode(), host.encode(), worker_nonce.encode()]


def _welcome_parts(worker_nonce: str, parent_nonce: str, rank: int) -> list[bytes]:
    return [worker_nonce.encode(), parent_nonce.encode(), str(rank).encode()]


def _prove(token: str, tag: bytes, parts: list[bytes]) -> str:
    """The core's MAC of ``parts`` under the token, in the domain ``tag``, as hex."""
    return _core.auth_mac(_core.secret_from_text(token), tag, parts).hex()


def _is_proof(token: str, tag: bytes, parts: list[bytes], claimed: object) -> bool:
    """Whether ``claimed`` is :func:`_prove`'s hex (compared in constant time, by the core;
    anything that is not hex fails)."""
    try:
        proof = bytes.fromhex(claimed) if isinstance(claimed, str) else b""
    except ValueError:
        proof = b""
    return _core.auth_check(_core.secret_from_text(token), tag, parts, proof)


def hello_mac(token: str, parent_nonce: str, rank: int, pid: int, host: str, worker_nonce: str) -> str:
    """The worker's proof that it knows the token: the core's MAC (see the module docs) of
    the parent's challenge, the rank, the pid, the host it names and the worker's own
    nonce, as hex."""
    return _prove(token, _HELLO, _hello_parts(parent_nonce, rank, pid, host, worker_nonce))


def hello_is_genuine(
    token: str, parent_nonce: str, rank: int, pid: int, host: str, worker_nonce: str, claimed: object
) -> bool:
    """Whether ``claimed`` is :func:`hello_mac`."""
    return _is_proof(token, _HELLO, _hello_parts(parent_nonce, rank, pid, host, worker_nonce), claimed)


def welcome_mac(token: str, worker_nonce: str, parent_nonce: str, rank: int) -> str:
    """The parent's proof that it knows the token, over the worker's nonce: what the
    worker checks before it takes the parent's word for anything."""
    return _prove(token, _WELCOME, _welcome_parts(worker_nonce, parent_nonce, rank))


def welcome_is_genuine(token: str, worker_nonce: str, parent_nonce: str, rank: int, claimed: object) -> bool:
    """Whether ``claimed`` is :func:`welcome_mac`."""
    return _is_proof(token, _WELCOME, _welcome_parts(worker_nonce, parent_nonce, rank), claimed)


_HELLO = b"shmq worker hello"
_WELCOME = b"shmq worker welcome"
PARENT_TO_WORKER = b"shmq worker link: parent to worker"
WORKER_TO_PARENT = b"shmq worker link: worker to parent"
_SEAL = struct.Struct("!Q32s")


class SealedLink:
    """The frames after the handshake: each carries its number (each direction counts its
    own from 0) and its seal, the core's message MAC (``_core.auth_message_mac``, as the
    remote stream's messages) over the session (both nonces), the number, the kind and the
    payload, in a domain for each direction. :meth:`recv` raises ``ValueError`` for a
    frame that fails its seal or comes out of turn: the link is over then."""

    def __init__(self, sock: socket.socket, token: str, parent_nonce: str, worker_nonce: str, *, parent: bool):
        self.sock = sock
        self._key = _core.secret_from_text(token)
        # Both nonces' bytes (``ValueError`` for anything that is not one).
        self._session = _core.secret_from_text(parent_nonce) + _core.secret_from_text(worker_nonce)
        self._sends, self._receives = (
            (PARENT_TO_WORKER, WORKER_TO_PARENT) if parent else (WORKER_TO_PARENT, PARENT_TO_WORKER)
        )
        self._sent = 0
        self._received = 0
        self._send_lock = threading.Lock()  # several threads send; one receives

    def send(self, kind: bytes, payload: bytes) -> None:
        with self._send_lock:
            seq = self._sent
            seal = _core.auth_message_mac(self._key, self._sends, self._session, seq, [kind, payload])
            send_frame(self.sock, kind, _SEAL.pack(seq, seal) + payload)
            self._sent += 1

    def recv(self) -> tuple[bytes, bytes]:
        kind, body = recv_frame(self.sock)
        if len(body) < _SEAL.size:
            raise ValueError("a frame without its seal (is another process on this connection?)")
        seq, seal = _SEAL.unpack_from(body)
        payload = body[_SEAL.size :]
        if not _core.auth_message_check(self._key, self._receives, self._session, seq, [kind, payload], seal):
            raise ValueError("a frame failed authentication (is another process on this connection?)")
        if seq != self._received:
            raise ValueError(f"frame {seq} arrived where frame {self._received} was due: frames were lost")
        self._received += 1
        return kind, payload
