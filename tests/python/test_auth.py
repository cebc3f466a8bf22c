"""The one MAC that proves a secret and the one seal of a stream's messages
(``crates/core/src/auth.rs``), as the worker link uses them: each side's proof over the
other's nonce is the core's keyed MAC in a domain of its own, every frame after the
handshake carries the core's message seal; tickets carry a 32-byte token and refuse
anything else. (The queue's remote stream uses the same MAC and seal:
tests/python/test_remote_faults.py and the Rust unit tests.)"""

from __future__ import annotations

import secrets
import socket
import struct

import pytest

from shmq import _core
from shmq.workers.protocol import (
    MAX_FRAME,
    SealedLink,
    WorkerTicket,
    hello_is_genuine,
    hello_mac,
    recv_frame,
    send_frame,
    welcome_is_genuine,
    welcome_mac,
)


def test_the_worker_hello_and_welcome_are_the_cores_mac_in_domains_of_their_own() -> None:
    token, theirs, ours = secrets.token_hex(32), secrets.token_hex(32), secrets.token_hex(32)
    key = bytes.fromhex(token)
    answer = hello_mac(token, theirs, 3, 4242, "node-1", ours)
    parts = [theirs.encode(), b"3", b"4242", b"node-1", ours.encode()]
    assert bytes.fromhex(answer) == _core.auth_mac(key, b"shmq worker hello", parts)
    assert hello_is_genuine(token, theirs, 3, 4242, "node-1", ours, answer)
    # Another domain, rank, host, nonce or key, or not hex: refused.
    assert not _core.auth_check(key, b"hello", parts, bytes.fromhex(answer))
    assert not hello_is_genuine(token, theirs, 4, 4242, "node-1", ours, answer)
    assert not hello_is_genuine(token, theirs, 3, 4242, "node-2", ours, answer)
    assert not hello_is_genuine(token, theirs, 3, 4242, "node-1", secrets.token_hex(32), answer)
    assert not hello_is_genuine(secrets.token_hex(32), theirs, 3, 4242, "node-1", ours, answer)
    assert not hello_is_genuine(token, theirs, 3, 4242, "node-1", ours, "not hex")
    assert not hello_is_genuine(token, theirs, 3, 4242, "node-1", ours, None)
    # The parent's answer: over the worker's nonce, and never the hello's MAC.
    welcome = welcome_mac(token, ours, theirs, 3)
    assert welcome_is_genuine(token, ours, theirs, 3, welcome)
    assert welcome != answer and not welcome_is_genuine(token, ours, theirs, 3, answer)
    assert not welcome_is_genuine(token, secrets.token_hex(32), theirs, 3, welcome)


def _linked(token: str) -> tuple[SealedLink, SealedLink, socket.socket, socket.socket]:
    """A parent's and a worker's sealed link over a socket pair (the frames are TCP's
    bytes either way: the framing, not the transport, is under test here)."""
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    p_nonce, w_nonce = secrets.token_hex(32), secrets.token_hex(32)
    parent = SealedLink(a, token, p_nonce, w_nonce, parent=True)
    worker = SealedLink(b, token, p_nonce, w_nonce, parent=False)
    return parent, worker, a, b


def test_sealed_frames_arrive_in_order_and_each_seal_is_the_cores_message_mac() -> None:
    token = secrets.token_hex(32)
    parent, worker, a, b = _linked(token)
    try:
        worker.send(b"R", b"ready info")
        worker.send(b"X", b"{}")
        parent.send(b"S", b'{"grace": 1}')
        assert parent.recv() == (b"R", b"ready info")
        assert parent.recv() == (b"X", b"{}")
        assert worker.recv() == (b"S", b'{"grace": 1}')
        # On the wire: [length][kind][seq][seal][payload], the seal the core's.
        worker.send(b"R", b"x")
        kind, body = recv_frame(a)
        seq, seal = struct.unpack_from("!Q32s", body)
        session = parent._session
        assert (kind, seq, body[40:]) == (b"R", 2, b"x")
        assert seal == _core.auth_message_mac(
            bytes.fromhex(token), b"shmq worker link: worker to parent", session, 2, [b"R", b"x"]
        )
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("forgery", ["unsealed", "altered", "replayed", "reflected", "other session", "other key"])
def test_a_frame_that_is_not_the_peers_ends_the_link(forgery: str) -> None:
    token = secrets.token_hex(32)
    parent, worker, a, b = _linked(token)
    try:
        if forgery == "unsealed":  # what a process that knows no token can write
            send_frame(b, b"R", b"pickled payload")
        elif forgery == "altered":
            worker.send(b"R", b"info")
            kind, body = recv_frame(a)
            send_frame(b, kind, body[:-1] + b"!")  # on the worker's side of the pair
        elif forgery == "replayed":
            worker.send(b"R", b"info")
            kind, body = recv_frame(a)
            send_frame(b, kind, body)
            send_frame(b, kind, body)  # a recorded copy of frame 0, after frame 0
            assert parent.recv() == (b"R", b"info")
        elif forgery == "reflected":  # the parent's own frame sent back to it
            parent.send(b"S", b"{}")
            kind, body = recv_frame(b)
            send_frame(b, kind, body)
        elif forgery == "other session":
            _, other, c, d = _linked(token)
            other.send(b"R", b"info")
            kind, body = recv_frame(c)
            send_frame(b, kind, body)
            c.close()
            d.close()
        else:
            _, other, c, d = _linked(secrets.token_hex(32))
            other._session = worker._session
            other.send(b"R", b"info")
            kind, body = recv_frame(c)
            send_frame(b, kind, body)
            c.close()
            d.close()
        with pytest.raises(ValueError, match="authentication|without its seal|was due"):
            parent.recv()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("token", ["", "abc", "zz" * 32, "ab" * 31, "ab" * 33])
def test_a_ticket_needs_a_32_byte_token(token: str) -> None:
    with pytest.raises(ValueError, match="TOKEN 64 hexadecimal digits"):
        WorkerTicket.parse(f"shmq-workers://127.0.0.1:5000/{token}")


def test_a_secret_of_another_length_is_refused() -> None:
    with pytest.raises(ValueError, match="a secret is 32 bytes"):
        _core.auth_mac(b"short", b"tag", [b"x"])


def test_a_secret_has_one_text_form_for_handles_and_tickets() -> None:
    """The core writes and reads a secret's text (``auth::secret_to_text``): a queue
    handle's ``remote_secret`` and a worker ticket's token are the same form."""
    from shmq import MessageQueue

    text = _core.new_secret_text()
    assert len(text) == 64 and text == text.lower()
    assert _core.secret_from_text(text).hex() == text
    assert _core.secret_from_text(text.upper()).hex() == text
    WorkerTicket.parse(f"shmq-workers://127.0.0.1:5000/{text}")  # a ticket takes it
    mq = MessageQueue(1, 0, connect_ip="127.0.0.1")  # one remote reader: a secret
    try:
        secret = mq.export_handle().remote_secret
        assert secret is not None and _core.secret_from_text(secret).hex() == secret
    finally:
        mq.shutdown()
    for bad in ["", "ab" * 31, "ab" * 33, "zz" * 32, "é" * 64]:
        with pytest.raises(ValueError, match="a secret is 64 hexadecimal digits"):
            _core.secret_from_text(bad)


def test_a_payload_too_big_for_a_frame_is_refused_before_it_is_sealed() -> None:
    """The sender refuses a payload the peer would refuse to read (its frame over
    ``MAX_FRAME``), before sealing it: no number spent, the link goes on."""
    parent, worker, a, b = _linked(secrets.token_hex(32))
    try:
        too_big = bytes(MAX_FRAME - 40)  # + kind, number and seal: MAX_FRAME + 1
        with pytest.raises(ValueError, match=f"bad frame length {MAX_FRAME + 1}"):
            worker.send(b"R", too_big)
        worker.send(b"R", b"next")
        assert parent.recv() == (b"R", b"next")  # frame 0: nothing was spent on the refused one
    finally:
        a.close()
        b.close()
