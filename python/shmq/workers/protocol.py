"""What both sides share: the ticket a remote worker joins with, and the TCP protocol.

The protocol: frames of ``[4-byte big-endian length][1-byte kind][payload]``::

    parent -> worker   C  {"nonce": hex}                       challenge
    worker -> parent   H  {"rank", "pid", "host", "mac"}       mac = MAC(token, nonce, rank, pid)
    parent -> worker   A  {"ok": bool, "error": str}           admitted, or why not
    worker -> parent   R  pickle(info)                          ready (only once admitted)
    worker -> parent   X  {"exitcode", "stderr": [lines]}       leaving
    parent -> worker   S  {"grace": seconds}                    stop

The token never crosses the network (only a MAC over a fresh challenge), so a recorded
handshake cannot be replayed. The MAC is the queue's remote stream's (``crates/core/src/auth.rs``:
keyed BLAKE3 over a domain tag and length-prefixed parts, through ``_core.auth_mac``),
in a domain of its own, so one implementation proves the secret for both. The parent
unpickles only frames from an admitted worker; the worker unpickles nothing.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass, field

from .. import _core

__all__ = ["DEFAULT_GRACE", "WorkerTicket"]

DEFAULT_GRACE = 5.0
"""Seconds a shutdown waits after SIGTERM before it sends SIGKILL."""

HANDSHAKE_TIMEOUT = 10.0
MAX_FRAME = 64 << 20


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
        if not host or not port.isdigit() or not _is_token(token):
            raise ValueError(
                f"not a worker ticket (expected {prefix}HOST:PORT/TOKEN, TOKEN 64 hexadecimal digits): {text[:40]!r}"
            )
        return cls(host.strip("[]"), int(port), token)


def send_frame(sock: socket.socket, kind: bytes, payload: bytes) -> None:
    sock.sendall(struct.pack("!I", len(payload) + 1) + kind + payload)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> tuple[bytes, bytes]:
    (length,) = struct.unpack("!I", recv_exact(sock, 4))
    if not 1 <= length <= MAX_FRAME:
        raise ValueError(f"bad frame length {length}")
    data = recv_exact(sock, length)
    return data[:1], data[1:]


def _is_token(token: str) -> bool:
    """Whether ``token`` is a ticket's token: 32 bytes as 64 hexadecimal digits."""
    try:
        _core.secret_from_text(token)
    except ValueError:
        return False
    return True


def mac(token: str, nonce: str, rank: int, pid: int) -> str:
    """The worker's answer to the parent's challenge ``nonce``: the core's keyed MAC (see
    the module docs) of the nonce, the rank and the pid under the token, as hex."""
    parts = [nonce.encode(), str(rank).encode(), str(pid).encode()]
    return _core.auth_mac(_core.secret_from_text(token), b"shmq worker hello", parts).hex()
