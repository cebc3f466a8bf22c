"""The one MAC that proves a secret and the one seal of a stream's messages
(``crates/core/src/auth.rs``), as the worker link uses them: each side's proof over the
other's nonce is the core's keyed MAC in a domain of its own, every frame after the
handshake carries the core's message seal; tickets carry a 32-byte token and refuse
anything else. (The queue's remote stream uses the same MAC and seal:
tests/python/test_remote_faults.py and the Rust unit tests.)"""

from __future__ import annotations


import pytest

from shmq import _core
from shmq.workers.protocol import MAX_FRAME, WorkerTicket


# The worker link's handshake proofs and seals are the core's, at both ends
# (``crates/workers/src/link/tests.rs``: the hello and welcome MACs in domains of their
# own, sealed frames in order, and an altered, replayed, reflected, unsealed frame or one
# of another session or key refused); ``test_workers.py`` and
# ``test_worker_port_hostile.py`` check them against a peer written by hand
# (``_link_by_hand.py``).


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
    import threading

    listener = _core.LinkListener("127.0.0.1", 0)
    accepted: list[_core.Link] = []
    t = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
    t.start()
    worker = _core.Link.connect(listener.ticket, 0, 30.0)
    t.join(30)
    parent = accepted[0]
    try:
        too_big = bytes(MAX_FRAME - 40)  # + kind, number and seal: MAX_FRAME + 1
        with pytest.raises(ValueError, match=f"bad frame length {MAX_FRAME + 1}"):
            worker.send_ready(too_big)
        worker.send_ready(b"next")
        assert parent.recv() == (_core.LinkKind.READY, b"next")  # frame 0: nothing was spent on the refused one
    finally:
        parent.shutdown()
        worker.shutdown()
