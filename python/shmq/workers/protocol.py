"""What both sides share: the ticket a remote worker joins with, and the link's limits.

The link itself is Rust's at both ends (``shmq::workers::link``, ``crates/workers/src/link/``,
through ``shmq._core``): the parent's accept loop, its handshake slots and deadline, the
handshake (each side's proof of the ticket's token over the other's fresh nonce: the token
never crosses the network), the seal of every frame after it, and the worker's end. Its
frames' kinds are the core's ``link::Kind`` (``_core.LinkKind``); its wire format and its
guarantees: the module docs of ``crates/workers/src/link/mod.rs``. The parent unpickles
only a sealed ready frame from an admitted worker; the worker unpickles nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import _core

__all__ = ["DEFAULT_GRACE", "WorkerTicket"]

DEFAULT_GRACE = 5.0
"""Seconds a shutdown waits after SIGTERM before it sends SIGKILL."""

HANDSHAKE_TIMEOUT: float = _core.LINK_HANDSHAKE_TIMEOUT
"""Seconds the parent gives one connection for its whole handshake, from its accept to the
worker's hello (every read and write of it together, not each read; the welcome of a
worker that proved the token then has this long again). A worker's side has one deadline
of its own for its whole handshake: ``connect_to_parent``'s ``timeout``."""
MAX_HANDSHAKES: int = _core.LINK_MAX_HANDSHAKES
"""Connections in their handshake at once on a parent's port (32). With every slot taken, a
new connection takes the slot of the oldest connection still waiting for its hello of the
host with the most such connections (which is dropped): a stranger flooding the port from
one host pushes out its own connections, and a genuine worker still gets in."""
MAX_FRAME: int = _core.LINK_MAX_FRAME
"""The largest frame of an admitted link, either way (16 MiB: its kind, number, seal and
payload, so a remote worker's pickled ready ``info`` is at most 41 bytes less). A longer
length is refused as it is read, before any of the frame's body, and ends the link (the
parent reports the worker lost, naming the peer and the limit); a sender refuses to send
one (``ValueError``). Each end holds one frame at a time, read as its bytes come into a
buffer that grows with them (never to the claimed length up front)."""
MAX_HELLO_FRAME: int = _core.LINK_MAX_HELLO_FRAME
"""The largest handshake frame (challenge, hello, answer), which either end reads before
the other proved the token. A longer length is refused as it is read, before any of the
frame's body: ``ConnectionError`` naming the peer and the limit."""


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


def is_secret_text(text: str) -> bool:
    """Whether ``text`` is 32 bytes in a secret's one text form (the core's
    ``secret_from_text``): a ticket's token, a handshake nonce."""
    try:
        _core.secret_from_text(text)
    except ValueError:
        return False
    return True
