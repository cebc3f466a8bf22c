"""What both sides share: the ticket a remote worker joins with, and the link's protocol.

The link's protocol is Rust's (``shmq::workers::link``, ``crates/workers/src/link/``,
through ``shmq._core``): the handshake's messages, each side's proof of the ticket's token
over the other's fresh nonce (the core's ``auth`` MAC), and the seal of every frame after
it (the core's message MAC), the same that Rust parents and workers speak. What stays here
is Python's sockets: the frames' reads and writes, their deadlines. The transport is the
link's own: one TCP connection, whose loss is the worker's death.

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
ends the link, and so does a sealed frame of a kind never the peer's to send (a
handshake's, or the receiver's own; a kind this version does not know is skipped); a last
frame lost with the connection is the connection's loss. The parent
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

HANDSHAKE_TIMEOUT: float = _core.LINK_HANDSHAKE_TIMEOUT
"""Seconds the parent gives one connection for its whole handshake, from its accept to the
worker's hello (every read and write of it together, not each read; the welcome of a
worker that proved the token then has this long again). A worker's side has one deadline
of its own for its whole handshake: ``connect_to_parent``'s ``timeout``."""
PROTOCOL_VERSION: int = _core.LINK_PROTOCOL_VERSION
"""The link's protocol, in the parent's challenge (an older shmq's had none)."""
MAX_FRAME: int = _core.LINK_MAX_FRAME
"""The largest frame of an admitted link, either way (16 MiB: its kind, number, seal and
payload, so a remote worker's pickled ready ``info`` is at most 41 bytes less). A longer
length is refused as it is read, before any of the frame's body, and ends the link
(``ValueError`` naming the peer and the limit; the parent reports the worker lost); a
sender refuses to send one (:meth:`SealedLink.send`). Each end holds one frame at a time,
read as its bytes come into a buffer that grows with them (at most doubling what arrived,
never to the claimed length up front), so a peer that floods frames costs the receiver
about twice this at most, and nothing once each frame is handled."""
MAX_HELLO_FRAME: int = _core.LINK_MAX_HELLO_FRAME
"""The largest handshake frame (challenge, hello, answer), which either end reads before
the other proved the token (the hello is about 300 bytes, its longest field the host name,
at most 255 bytes before JSON's escapes; the challenge about 100). A longer length is
refused as it is read, before any of the frame's body: ``ConnectionError`` naming the peer
and the limit."""
_SEAL_BYTES: int = _core.LINK_SEAL_BYTES  # a sealed frame's number and seal, before its payload
_RECV_CHUNK = 64 << 10  # a frame's buffer's first room (it then grows with what arrived)


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


def send_frame_by(sock: socket.socket, deadline: float, kind: bytes, payload: bytes) -> None:
    """``send_frame`` within what is left of a handshake's ``deadline`` (a
    ``time.monotonic()`` time): ``TimeoutError`` once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline passed")
    sock.settimeout(left)
    send_frame(sock, kind, payload)


def recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytearray:
    """``n`` bytes, read as they come into one buffer that grows with them (room for as
    much again as arrived, 64 KiB at first, never the ``n`` claimed up front: a peer that
    announces much and sends little costs little; one buffer, so nothing of it stays
    behind in the allocator's small blocks once it is freed). With ``deadline`` (a
    ``time.monotonic()`` time), every read waits only for what is left of it, and
    ``TimeoutError`` comes once it passed: a peer that sends a byte now and then cannot
    stretch the whole read past it."""
    buf = bytearray()
    got = 0
    while got < n:
        if got == len(buf):
            # ``bytes(k)`` is calloc'd: large ones are fresh zero pages, never touched here.
            buf += bytes(min(n - got, max(got, _RECV_CHUNK)))
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the deadline passed")
            sock.settimeout(left)
        with memoryview(buf) as view, view[got:] as room:
            k = sock.recv_into(room)  # TimeoutError at the deadline
        if not k:
            raise EOFError("connection closed")
        got += k
    return buf


def _recv_head(
    sock: socket.socket, max_length: int, deadline: Optional[float], peer: str, handshake: bool
) -> tuple[bytes, int]:
    """A frame's kind and the length of its payload, its length checked by the core
    (``link::frame_length``) before anything more is read."""
    length = _core.link_frame_length(bytes(recv_exact(sock, 4, deadline)), max_length, peer, handshake)
    return bytes(recv_exact(sock, 1, deadline)), length - 1


def recv_frame(
    sock: socket.socket,
    max_length: int = MAX_FRAME,
    deadline: Optional[float] = None,
    *,
    peer: str = "the peer",
    handshake: bool = False,
) -> tuple[bytes, bytes]:
    """One frame's kind and payload. A length over ``max_length`` is refused before any of
    the frame's body is read: ``ConnectionError`` for a handshake frame (``handshake``),
    else ``ValueError``, naming ``peer`` (the sender) and the limit; ``deadline`` (for the
    whole frame): see :func:`recv_exact`."""
    kind, n = _recv_head(sock, max_length, deadline, peer, handshake)
    return kind, bytes(recv_exact(sock, n, deadline))


def peer_text(address: object) -> str:
    """An address as errors name a peer: ``HOST:PORT`` (an IPv6 host in brackets)."""
    if isinstance(address, tuple) and len(address) >= 2:
        host = str(address[0])
        return f"[{host}]:{address[1]}" if ":" in host else f"{host}:{address[1]}"
    return str(address)


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


def hello_mac(token: str, parent_nonce: str, rank: int, pid: int, host: str, worker_nonce: str) -> str:
    """The worker's proof that it knows the token: the core's MAC (see the module docs) of
    the parent's challenge, the rank, the pid, the host it names and the worker's own
    nonce, as hex."""
    return _core.link_hello_mac(token, parent_nonce, rank, pid, host, worker_nonce)


def hello_is_genuine(
    token: str, parent_nonce: str, rank: int, pid: int, host: str, worker_nonce: str, claimed: object
) -> bool:
    """Whether ``claimed`` is :func:`hello_mac` (compared in constant time; anything that
    is not its hex fails)."""
    want = hello_mac(token, parent_nonce, rank, pid, host, worker_nonce)
    return isinstance(claimed, str) and _core.link_proof_eq(want, claimed)


def welcome_mac(token: str, worker_nonce: str, parent_nonce: str, rank: int) -> str:
    """The parent's proof that it knows the token, over the worker's nonce: what the
    worker checks before it takes the parent's word for anything."""
    return _core.link_welcome_mac(token, worker_nonce, parent_nonce, rank)


def welcome_is_genuine(token: str, worker_nonce: str, parent_nonce: str, rank: int, claimed: object) -> bool:
    """Whether ``claimed`` is :func:`welcome_mac`."""
    want = welcome_mac(token, worker_nonce, parent_nonce, rank)
    return isinstance(claimed, str) and _core.link_proof_eq(want, claimed)


# The handshake's messages, made and checked by the Rust core (``shmq::workers::link``).


def challenge_payload(nonce: str) -> bytes:
    """The parent's challenge (``C``) with its fresh ``nonce``."""
    return _core.link_challenge(nonce)


def read_challenge(kind: bytes, payload: bytes, peer: str) -> str:
    """The parent's nonce from its challenge; ``ConnectionError`` for what is no shmq
    parent's challenge, ``PermissionError`` for a parent of another protocol version."""
    return _core.link_read_challenge(kind, payload, peer)


def hello_payload(token: str, parent_nonce: str, rank: int, pid: int, host: str) -> tuple[bytes, str]:
    """A worker's hello (``H``) and the fresh nonce it carries."""
    return _core.link_hello(token, parent_nonce, rank, pid, host)


def check_hello(token: str, parent_nonce: str, kind: bytes, payload: bytes) -> tuple[int, int, str, str]:
    """The hello in a frame, if well formed and proving the token: (rank, pid, host, the
    worker's nonce). ``ValueError`` says why it is refused ("wrong token", "malformed
    hello...")."""
    return _core.link_check_hello(token, parent_nonce, kind, payload)


def welcome_payload(token: str, worker_nonce: str, parent_nonce: str, rank: int) -> bytes:
    """The parent's answer (``A``) admitting worker ``rank``, with its proof."""
    return _core.link_welcome(token, worker_nonce, parent_nonce, rank)


def refusal_payload(error: str) -> bytes:
    """The parent's answer (``A``) refusing a worker, saying why."""
    return _core.link_refusal(error)


def read_answer(
    kind: bytes, payload: bytes, token: str, worker_nonce: str, parent_nonce: str, rank: int, peer: str
) -> None:
    """Check the parent's answer: ``PermissionError`` if it refused worker ``rank`` or
    cannot prove the token (it is not the parent that issued the ticket)."""
    _core.link_read_answer(kind, payload, token, worker_nonce, parent_nonce, rank, peer)


class SealedLink:
    """The frames after the handshake: each carries its number (each direction counts its
    own from 0) and its seal, the core's message MAC over the session (both nonces), the
    number, the kind and the payload, in a domain for each direction (``_core.LinkSeal``,
    Rust's ``SealOut``/``SealIn``). :meth:`recv` raises ``ValueError`` for a frame that
    fails its seal or comes out of turn: the link is over then."""

    def __init__(
        self,
        sock: socket.socket,
        token: str,
        parent_nonce: str,
        worker_nonce: str,
        *,
        parent: bool,
        peer: str = "the peer",
    ):
        self.sock = sock
        self.peer = peer  # as errors name the other end
        self._key = _core.secret_from_text(token)
        self._parent = parent
        # Both nonces' bytes (``ValueError`` for anything that is not one).
        self._session = _core.secret_from_text(parent_nonce) + _core.secret_from_text(worker_nonce)
        self._send_lock = threading.Lock()  # several threads send; one receives

    @property
    def _session(self) -> bytes:
        return self.__session

    @_session.setter
    def _session(self, session: bytes) -> None:
        self.__session = session
        self._seal = _core.LinkSeal(self._key, session, self._parent)

    def send(self, kind: bytes, payload: bytes) -> None:
        """Send one sealed frame. A payload that would make a frame over ``MAX_FRAME``
        (the most the peer reads) raises ``ValueError`` here, before it is sealed: the
        link goes on, and the peer never sees it (as Rust's ``LinkSender::send``)."""
        length = 1 + _SEAL_BYTES + len(payload)
        if length > MAX_FRAME:
            raise ValueError(f"bad frame length {length} (at most {MAX_FRAME} here)")
        with self._send_lock:
            send_frame(self.sock, kind, self._seal.seal(kind, payload))

    def recv(self) -> tuple[bytes, bytes]:
        """The next frame's kind and payload: one frame of at most ``MAX_FRAME`` held at
        a time (its body read into one buffer, then the payload copied out of it once).
        ``ValueError`` for a frame over ``MAX_FRAME`` (refused at its length, naming the
        peer and the limit), or one that fails its seal or comes out of turn: the link is
        over then. ``EOFError`` or ``OSError``: the connection's loss."""
        kind, n = _recv_head(self.sock, MAX_FRAME, None, self.peer, False)
        return kind, self._seal.open(kind, recv_exact(self.sock, n))
