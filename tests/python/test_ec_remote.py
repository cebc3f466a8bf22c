"""The encoder-cache connector across nodes (``remote_handle_file``, ``shmq._ec_remote``):
the encoder's side in a process of its own with a private ``/dev/shm`` (another node's,
where ``unshare`` allows), this process as the prefill/decode instance's scheduler (the
intake, writing into this node's cache), a third process as a TP worker loading from it.

What is checked: an item is in this node's cache, readable by another process, when
the encoder's flush returns (the intake made slow on purpose, so that a flush that did
not wait would be seen); what a killed encoder sent stays, and the next encoder's stream
is joined; a handle file that is not the user's own (others may read or write it, or a
symbolic link) is refused; an encoder with nobody on its stream neither hangs nor
sends.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from _processes import private_shm
from shmq import EncoderCacheIndex
from shmq._ec_remote import JOIN_TIMEOUT, RemoteIntake, read_handle_file

SENDER = os.path.join(os.path.dirname(__file__), "_processes", "ec_remote_sender.py")
STEP = 60.0


class Sender:
    """The encoder's side, a process of its own (another node's ``/dev/shm`` where it can)."""

    def __init__(self, handle_file: str):
        argv = [sys.executable, SENDER, handle_file]
        if private_shm.namespace_reason() is None:
            argv = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sender", *argv]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._line() == "READY"

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the sender ended (exit {self.proc.wait(STEP)})"
        return line.strip()

    def __call__(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(STEP)


def _loaded_in_another_process(name: str, keys: list[str]) -> dict[str, list]:
    """What a TP worker of this node (another process) loads: each key's shape and values."""
    script = (
        "import json, sys; from shmq import EncoderCacheConsumer\n"
        "c = EncoderCacheConsumer(sys.argv[1]); got = {}\n"
        "missing = c.load(sys.argv[2:], got)\n"
        "print(json.dumps({k: [list(v.shape), sorted(set(v.float().flatten().tolist()))] for k, v in got.items()}))\n"
        "c.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", script, name, *keys], capture_output=True, text=True, timeout=STEP)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _intake(cache_name: str, handle_file: str) -> RemoteIntake:
    return RemoteIntake(
        cache_name, handle_file, capacity=64 << 20, max_entries=64, timeout=1.0, unread_ttl=30.0
    )


def _until(what, timeout: float = STEP):
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, "not within the step"
        time.sleep(0.02)
    return got


def test_an_item_is_in_this_nodes_cache_when_the_encoders_flush_returns(tmp_path, cache_name):
    handle_file = str(tmp_path / "epd.handle")
    intake = _intake(cache_name, handle_file)
    # The intake slowed down on purpose: a flush that returned before it published would
    # leave the keys missing below.
    save = intake._saver._save_or_evict

    def slow_save(key, value):
        time.sleep(0.3)
        save(key, value)

    intake._saver._save_or_evict = slow_save  # type: ignore[method-assign]
    sender = Sender(handle_file)
    index = None
    try:
        # The file is the user's own, owner-only, written by the sender.
        assert os.stat(handle_file).st_mode & 0o777 == 0o600
        keys = [f"picture-{i}" for i in range(3)]
        for i, key in enumerate(keys):
            # The first save waits (at most JOIN_TIMEOUT) for the intake to join.
            assert sender(f"save {key} {i + 1} 576") == f"SAVED {key} True"
        assert sender("flush") == "FLUSHED"
        index = EncoderCacheIndex(cache_name)
        assert index.missing(keys) == []
        got = _loaded_in_another_process(cache_name, keys)
        assert got == {key: [[576, 64], [float(i + 1)]] for i, key in enumerate(keys)}
        assert intake.received == 3
        assert sender("quit") == "CLOSED"
        assert sender.proc.wait(STEP) == 0
        assert not os.path.exists(handle_file)  # the encoder's normal end takes its file
    finally:
        sender.kill()
        if index is not None:
            index.close()
        intake.close()


def test_a_killed_encoders_items_stay_and_the_next_encoders_stream_is_joined(tmp_path, cache_name, caplog):
    handle_file = str(tmp_path / "epd.handle")
    intake = _intake(cache_name, handle_file)
    first = Sender(handle_file)
    index = EncoderCacheIndex(cache_name)
    try:
        assert first("save old 7 16") == "SAVED old True"
        assert first("flush") == "FLUSHED"
        with caplog.at_level(logging.WARNING, logger="shmq.encoder_cache"):
            first.kill()
            # The intake sees its stream end within shmq's heartbeat bound (4 s + 1 s).
            _until(lambda: "stream" in caplog.text and "ended" in caplog.text, timeout=5.0 + 5.0)
        assert index.has("old")
        # A new encoder (its own stream, a new handle in the same file) is joined.
        second = Sender(handle_file)
        try:
            assert second("save new 9 16") == "SAVED new True"
            assert second("flush") == "FLUSHED"
            assert index.has("new") and index.has("old")
            got = _loaded_in_another_process(cache_name, ["old", "new"])
            assert got == {"old": [[16, 64], [7.0]], "new": [[16, 64], [9.0]]}
        finally:
            second.kill()
    finally:
        first.kill()
        index.close()
        intake.close()


def test_an_encoder_with_nobody_on_its_stream_sends_nothing_and_does_not_hang(tmp_path):
    sender = Sender(str(tmp_path / "epd.handle"))
    try:
        t = time.monotonic()
        assert sender("save lonely 1 16") == "SAVED lonely False"
        assert sender("flush") == "FLUSHED"
        assert time.monotonic() - t < JOIN_TIMEOUT + 10.0
    finally:
        sender.kill()


@pytest.mark.parametrize("case", ["group-readable", "world-writable", "symlink", "another-users"])
def test_a_handle_file_others_may_touch_is_refused(tmp_path, cache_name, case):
    path = tmp_path / "epd.handle"
    if case == "symlink":
        target = tmp_path / "real"
        target.write_text("shmq-handle-3|...\n")
        os.chmod(target, 0o600)
        os.symlink(target, path)
        match = "symbolic link"
    elif case == "another-users":
        if os.geteuid() != 0:
            pytest.skip("making a file of another user's needs root")
        path.write_text("shmq-handle-3|...\n")
        os.chmod(path, 0o600)
        os.chown(path, 65534, 65534)
        match = "belongs to uid 65534, not to this user"
    else:
        path.write_text("shmq-handle-3|...\n")
        os.chmod(path, 0o640 if case == "group-readable" else 0o602)
        match = "others may read or write it"
    with pytest.raises(PermissionError, match=match):
        read_handle_file(str(path))
    with pytest.raises(PermissionError, match=match):
        _intake(cache_name, str(path))
    # Nothing was made under the cache's name.
    assert not [n for n in os.listdir("/dev/shm") if cache_name in n]


def test_a_value_that_is_no_tensor_is_refused_by_the_encoders_side(tmp_path):
    from shmq._ec_remote import RemoteSender

    sender = RemoteSender(str(tmp_path / "epd.handle"), ip="127.0.0.1")
    try:
        with pytest.raises(TypeError, match="only a tensor"):
            sender.save("k", {"not": "a tensor"})
    finally:
        sender.close()


def test_a_dead_encoders_file_at_start_is_passed_over_and_close_does_not_wait_for_it(tmp_path, cache_name):
    handle_file = str(tmp_path / "epd.handle")
    dead = Sender(handle_file)
    dead.kill()  # its file stays, naming a port nobody serves
    intake = _intake(cache_name, handle_file)
    try:
        time.sleep(1.0)  # the intake is trying the dead encoder's port
        live = Sender(handle_file)
        try:
            assert live("save k 3 8") == "SAVED k True"
            assert live("flush") == "FLUSHED"
            assert _loaded_in_another_process(cache_name, ["k"]) == {"k": [[8, 64], [3.0]]}
        finally:
            live.kill()
    finally:
        t = time.monotonic()
        intake.close()
        assert time.monotonic() - t < 3.0


def test_a_restarted_prefill_decode_side_gets_a_new_stream_from_the_running_encoder(tmp_path, cache_name):
    handle_file = str(tmp_path / "epd.handle")
    first = _intake(cache_name, handle_file)
    sender = Sender(handle_file)
    try:
        assert sender("save a 1 8") == "SAVED a True"
        assert sender("flush") == "FLUSHED"
        first.close()  # the prefill/decode instance ends (its cache with it)
        second = _intake(cache_name, handle_file)
        try:
            # The encoder finds its reader gone at its next save and makes a new stream
            # (a new file), which the new intake joins: an item or two may be encoded on
            # node 0 meanwhile (not sent), none is lost once it says sent.
            sent = []
            for i in range(10):
                if sender(f"save b{i} {i} 8") == f"SAVED b{i} True":
                    sent.append(f"b{i}")
                assert sender("flush") == "FLUSHED"
                if sent:
                    break
                time.sleep(0.5)
            assert sent, "the running encoder never reached the restarted intake"
            assert _loaded_in_another_process(cache_name, sent) == {sent[0]: [[8, 64], [float(sent[0][1:])]]}
        finally:
            second.close()
    finally:
        sender.kill()
