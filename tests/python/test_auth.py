"""The one MAC that proves a secret (``crates/core/src/auth.rs``), as the worker handshake uses it:
the worker's answer to the parent's challenge is the core's keyed MAC in a domain of its
own; tickets carry a 32-byte token and refuse anything else. (The queue's remote stream
uses the same MAC: tests/python/test_remote_faults.py and the Rust unit tests.)"""

from __future__ import annotations

import secrets

import pytest

from shmq import _core
from shmq.workers.protocol import WorkerTicket, mac


def test_the_worker_hello_is_the_cores_mac_in_its_own_domain() -> None:
    token, nonce = secrets.token_hex(32), secrets.token_hex(32)
    answer = mac(token, nonce, 3, 4242)
    parts = [nonce.encode(), b"3", b"4242"]
    key = bytes.fromhex(token)
    assert bytes.fromhex(answer) == _core.auth_mac(key, b"shmq worker hello", parts)
    assert _core.auth_check(key, b"shmq worker hello", parts, bytes.fromhex(answer))
    # Another domain, another rank, another key: another MAC.
    assert not _core.auth_check(key, b"hello", parts, bytes.fromhex(answer))
    assert mac(token, nonce, 4, 4242) != answer
    assert mac(secrets.token_hex(32), nonce, 3, 4242) != answer


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
