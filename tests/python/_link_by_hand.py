"""The worker link's wire format, written by hand for tests that play a peer misbehaving
in ways the package's link (Rust's, ``shmq._core.Link``) never would: raw frames, a
hello made field by field, sealed frames of any size or kind. An independent writing of
the format of ``crates/workers/src/link/mod.rs`` from the core's MACs (``_core.auth_mac``,
``_core.auth_message_mac``), so that the tests also check that the core speaks it.

Frames are ``[4-byte big-endian length][1-byte kind][payload]``; after the handshake
the payload is the frame's 8-byte big-endian number, its 32-byte seal, then the message.
"""

from __future__ import annotations

import json
import os
import socket
import struct

from shmq import _core
from shmq.workers import WorkerTicket

PROTOCOL_VERSION = 2  # the link's, in the parent's challenge
_WORKER_TO_PARENT = b"shmq worker link: worker to parent"
_PARENT_TO_WORKER = b"shmq worker link: parent to worker"


def frame(kind: bytes, payload: bytes) -> bytes:
    return struct.pack("!I", len(payload) + 1) + kind + payload


def send_frame(sock: socket.socket, kind: bytes, payload: bytes) -> None:
    sock.sendall(frame(kind, payload))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise EOFError("connection closed")
        buf += got
    return bytes(buf)


def recv_frame(sock: socket.socket, max_length: int = 1 << 30) -> tuple[bytes, bytes]:
    """One frame's kind and payload (``ValueError`` for a length over ``max_length``)."""
    (length,) = struct.unpack("!I", _recv_exact(sock, 4))
    if not 0 < length <= max_length:
        raise ValueError(f"bad frame length {length}")
    body = _recv_exact(sock, length)
    return body[:1], body[1:]


def challenge(nonce: str) -> bytes:
    """A parent's challenge's payload."""
    return json.dumps({"nonce": nonce, "version": PROTOCOL_VERSION}).encode()


def hello_mac(token: str, parent_nonce: str, rank: int, pid: int, host: str, worker_nonce: str) -> str:
    parts = [parent_nonce.encode(), str(rank).encode(), str(pid).encode(), host.encode(), worker_nonce.encode()]
    return _core.auth_mac(bytes.fromhex(token), b"shmq worker hello", parts).hex()


def welcome_mac(token: str, worker_nonce: str, parent_nonce: str, rank: int) -> str:
    parts = [worker_nonce.encode(), parent_nonce.encode(), str(rank).encode()]
    return _core.auth_mac(bytes.fromhex(token), b"shmq worker welcome", parts).hex()


class SealedEnd:
    """A worker's end of an admitted link, by hand: :meth:`send` seals any kind and size
    (what ``_core.Link.send`` refuses to), :meth:`recv` opens the parent's frames."""

    def __init__(self, sock: socket.socket, token: str, parent_nonce: str, worker_nonce: str):
        self.sock = sock
        self._key = bytes.fromhex(token)
        self._session = bytes.fromhex(parent_nonce) + bytes.fromhex(worker_nonce)
        self._next = 0
        self._due = 0

    def sealed(self, kind: bytes, payload: bytes) -> bytes:
        """The next frame of ``kind``, sealed (its number spent)."""
        seal = _core.auth_message_mac(self._key, _WORKER_TO_PARENT, self._session, self._next, [kind, payload])
        body = struct.pack("!Q", self._next) + seal + payload
        self._next += 1
        return frame(kind, body)

    def send(self, kind: bytes, payload: bytes) -> None:
        self.sock.sendall(self.sealed(kind, payload))

    def recv(self) -> tuple[bytes, bytes]:
        """The parent's next frame, its seal checked (``ValueError`` if it fails)."""
        kind, body = recv_frame(self.sock)
        (seq,) = struct.unpack_from("!Q", body)
        want = _core.auth_message_mac(self._key, _PARENT_TO_WORKER, self._session, seq, [kind, body[40:]])
        if seq != self._due or want != body[8:40]:
            raise ValueError("a frame that is not the parent's")
        self._due += 1
        return kind, body[40:]


def join(ticket: WorkerTicket, rank: int, host: str = "here", timeout: float = 60.0) -> SealedEnd:
    """The genuine handshake of remote worker ``rank``, made by hand: what a hostile worker
    that knows the token does before it misbehaves. Checks the parent's proof too."""
    sock = socket.create_connection((ticket.host, ticket.port), timeout=timeout)
    kind, payload = recv_frame(sock, 4096)
    assert kind == b"C", kind
    theirs, ours, pid = json.loads(payload)["nonce"], _core.new_secret_text(), os.getpid()
    proof = hello_mac(ticket.token, theirs, rank, pid, host, ours)
    hello = {"rank": rank, "pid": pid, "host": host, "nonce": ours, "mac": proof}
    send_frame(sock, b"H", json.dumps(hello).encode())
    kind, payload = recv_frame(sock, 4096)
    answer = json.loads(payload)
    assert kind == b"A" and answer["ok"], answer
    assert answer["mac"] == welcome_mac(ticket.token, ours, theirs, rank)  # the parent proved the token
    return SealedEnd(sock, ticket.token, theirs, ours)
