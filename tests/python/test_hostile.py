"""Hostile input and real deployments: peers in other pid namespaces, fork, strangers on
the remote port, a process on a dead writer's port, another user at the local socket,
the same rank opened twice. Each test is an attack that succeeded before shmq's role
locks, fork handling and authenticated remote stream; all run in real processes.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from _processes import STEP, WaitTimeout, hold_rank, wait_for, raw_chunk_keeper, remote_writer_then_sleep
from shmq import MessageQueue, PeerDiedError

HERE = Path(__file__).resolve().parent
PEER = str(HERE / "_processes" / "hostile_peer.py")


def _b64(obj) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


def _unshare_works() -> str | None:
    """Why pid namespaces cannot be made here, or None if they can."""
    try:
        r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=STEP)
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        return f"unshare is not usable: {e}"
    return None if r.returncode == 0 else f"unshare --pid failed: {r.stderr.decode().strip()}"


def _peer(*args: str, prefix: tuple[str, ...] = (), user: int | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.Popen(
        [*prefix, sys.executable, PEER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        user=user,
    )


def _result(p: subprocess.Popen, timeout: float = 3 * STEP) -> dict:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"peer failed ({p.returncode}):\n{err}"
    return json.loads(out.strip().splitlines()[-1])


IN_OTHER_PID_NAMESPACE = ("unshare", "--pid", "--fork", "--mount-proc")


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_a_reader_in_another_pid_namespace_is_not_declared_dead(policy):
    reason = _unshare_works()
    if reason:
        pytest.skip(reason)
    # A small ring: the writer fills it and waits on the reader, checking on it as it
    # does on a dead one. In the reader's pid namespace its pid means nothing here.
    mq = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2, on_dead_reader=policy)
    reader = _peer("slow_reader", _b64(mq.export_handle()), prefix=IN_OTHER_PID_NAMESPACE)
    mq.wait_until_ready(timeout=STEP)
    sent = list(range(20))
    try:
        for i in sent:
            mq.enqueue(i, timeout=STEP)  # blocks while the reader sleeps: must not raise
        mq.enqueue(None, timeout=STEP)
    except PeerDiedError as e:  # the failure before role locks
        reader.kill()
        pytest.fail(f"a live reader in another pid namespace was declared dead: {e}")
    got = _result(reader)
    assert got["got"] == sent
    assert got["pid"] == 1, "the reader did not run as pid 1 of its own pid namespace"
    assert mq.dropped_readers == []


def test_cleanup_in_another_pid_namespace_keeps_live_segments():
    reason = _unshare_works()
    if reason:
        pytest.skip(reason)
    mq = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2)
    mq.reserve_arena(0)  # the arena is made at first use: make it now
    ring, arena = mq.buffer.name, mq.handle.arena_name
    seen = _result(_peer("cleanup", prefix=IN_OTHER_PID_NAMESPACE))
    assert ring not in seen["would_remove"] and arena not in seen["would_remove"], seen
    assert seen["states"][ring] == "alive", seen["states"].get(ring)
    # And the real thing, not a dry run: nothing of ours goes.
    done = subprocess.run(
        [*IN_OTHER_PID_NAMESPACE, sys.executable, "-m", "shmq", "cleanup"],
        capture_output=True,
        text=True,
        timeout=STEP,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    assert done.returncode == 0, done.stderr
    assert os.path.exists(f"/dev/shm/{ring}") and os.path.exists(f"/dev/shm/{arena}")
    assert os.path.exists(f"/dev/shm/{ring}.sock")
    del mq


def test_fork_after_making_a_writer_harms_nobody(tmp_path):
    # The "parent" is a program of its own, so that an abort in it is an exit code here.
    p = _peer("fork_then_exit", str(tmp_path / "child-said"))
    got = _result(p, timeout=STEP)
    assert got["child_status"] == 0, got
    assert got["child_took"] < STEP / 2, "the child hung on its way out"
    assert "cannot be used in the forked child" in got["child_said"], got["child_said"]
    # The stream is intact: nothing from the child got in.
    assert got["got"] == ["before", "after"], got


_FORK_MAKES_ITS_OWN_REMOTE_QUEUES = """
import os, threading
from shmq import MessageQueue

def pair():
    w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    r = MessageQueue.create_from_handle(w.export_handle(), 0)
    t = threading.Thread(target=r.wait_until_ready, kwargs={"timeout": 20})
    t.start()
    w.wait_until_ready(timeout=20)
    t.join()
    return w, r

w, r = pair()
w.enqueue("parent 1")
assert r.dequeue(timeout=20) == "parent 1"
pid = os.fork()
if pid == 0:
    w2, r2 = pair()
    w2.enqueue("child")
    ok = r2.dequeue(timeout=20) == "child"
    w2.shutdown()
    del w2, r2
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
w.enqueue("parent 2")
assert r.dequeue(timeout=20) == "parent 2"
print("child exit", os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_makes_remote_queues_of_its_own():
    # A process's remote sockets share one ZeroMQ context (transport::shared_context);
    # a forked child must make its own, not use (or tear down) the parent's.
    done = subprocess.run(
        [sys.executable, "-c", _FORK_MAKES_ITS_OWN_REMOTE_QUEUES],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["child", "exit", "0"], (done.stdout, done.stderr)


def _writer_with_one_remote_reader() -> MessageQueue:
    return MessageQueue(1, 0, connect_ip="127.0.0.1")


def _port(mq: MessageQueue) -> int:
    return int(mq.export_handle().remote_subscribe_addr.rsplit(":", 1)[1])


def test_raw_tcp_clients_and_strangers_do_not_count_as_readers():
    mq = _writer_with_one_remote_reader()
    port = _port(mq)
    raw = []
    for payload in (bytes([1, 0, 2, 0, 1]), random.Random(5).randbytes(4096)):
        s = socket.create_connection(("127.0.0.1", port), timeout=STEP)
        s.sendall(payload)
        raw.append(s)
    # A ZeroMQ client that speaks the protocol but has no secret.
    stranger = MessageQueue.create_from_handle(replace(mq.export_handle(), remote_secret="ab" * 32), 0)
    with pytest.raises(TimeoutError):
        mq.wait_until_ready(timeout=1.0)  # none of them counts
    real = MessageQueue.create_from_handle(mq.export_handle(), 0)
    t = threading.Thread(target=real.wait_until_ready, kwargs={"timeout": STEP})
    t.start()
    mq.wait_until_ready(timeout=STEP)
    t.join(STEP)
    for i in range(50):
        mq.enqueue({"i": i})
    assert [real.dequeue(timeout=STEP)["i"] for _ in range(50)] == list(range(50))
    # The stranger got nothing (and never became ready).
    with pytest.raises(TimeoutError):
        stranger.dequeue(timeout=0.5)
    for s in raw:
        s.close()


def test_a_second_reader_of_a_remote_rank_is_refused():
    mq = _writer_with_one_remote_reader()
    first = MessageQueue.create_from_handle(mq.export_handle(), 0)
    t = threading.Thread(target=first.wait_until_ready, kwargs={"timeout": STEP})
    t.start()
    mq.wait_until_ready(timeout=STEP)
    t.join(STEP)
    twin = MessageQueue.create_from_handle(mq.export_handle(), 0)
    refused: list[BaseException] = []

    def twin_joins() -> None:
        # Its wait is for its connection only: the refusal is its first receive's.
        try:
            twin.wait_until_ready(timeout=STEP)
            twin.dequeue(timeout=STEP)
        except BaseException as e:  # noqa: BLE001 - looked at below
            refused.append(e)

    t = threading.Thread(target=twin_joins)
    t.start()
    # The writer answers a hello whenever it sends; send until the twin has its answer
    # (one message every 0.05 s at most: the wait for the twin's end paces the sends).
    sent = 0
    while t.is_alive() and sent < STEP / 0.05:
        mq.enqueue(sent)
        sent += 1
        t.join(0.05)
    t.join(STEP)
    assert refused and isinstance(refused[0], ConnectionError), refused
    assert "rank 0 has joined already" in str(refused[0])
    assert [first.dequeue(timeout=STEP) for _ in range(sent)] == list(range(sent))


def test_a_process_on_a_dead_writers_port_cannot_feed_the_reader(tmp_path, children):
    import zmq

    out = children.queue()
    writer = children.start(remote_writer_then_sleep, out)
    handle = children.expect(out, "handle")[1]
    reader = MessageQueue.create_from_handle(handle, 0)
    reader.wait_until_ready(timeout=STEP)
    assert reader.dequeue(timeout=STEP) == "from the real writer"
    os.kill(writer.pid, signal.SIGKILL)
    writer.join(STEP)
    children.procs.remove(writer)
    # Someone else takes the port and sends what it likes: here a pickle that would
    # create a file when loaded (the CVE-2025-30165 class).
    port = int(handle.remote_subscribe_addr.rsplit(":", 1)[1])
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    ctx = zmq.Context()
    evil = ctx.socket(zmq.DEALER)
    # Tells when the reader has reconnected (its connection's ZMTP handshake is done).
    monitor = evil.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)

    def bound() -> bool:
        try:
            evil.bind(f"tcp://127.0.0.1:{port}")
            return True
        except zmq.ZMQError:
            return False

    try:
        wait_for(bound, STEP, "the dead writer's port to become free", 0.1)
    except WaitTimeout:
        pytest.skip("the dead writer's port did not become free")
    try:
        # The reader, not in a call, reconnects.
        assert monitor.poll(int(STEP * 1000)), "the reader never connected to the new port holder"
        monitor.recv_multipart()
        # A bare pickle: refused on its first bytes, and seen for what it is: the
        # writer's connection ended, so the writer is gone.
        evil.send(pickle.dumps(Payload()))
        with pytest.raises(PeerDiedError, match="is gone"):
            reader.dequeue(timeout=STEP)
        assert not marker.exists(), "the reader unpickled the stranger's bytes"
        # A message shaped like the writer's (a data header) without its session and
        # MAC: the reader takes nothing more once its writer is gone.
        evil.send_multipart([b"SQM1" + bytes(60), pickle.dumps(Payload())])
        with pytest.raises(PeerDiedError, match="is gone"):
            reader.dequeue(timeout=STEP)
        assert not marker.exists(), "the reader unpickled the stranger's bytes"
    finally:
        evil.disable_monitor()
        monitor.close(linger=0)
        evil.close(linger=0)
        ctx.term()


_CONNECT_AS_NOBODY = """
import json, os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
    print(json.dumps({"connected": True, "uid": os.getuid()}))
except OSError as e:
    print(json.dumps({"connected": False, "error": type(e).__name__, "uid": os.getuid()}))
"""


def test_another_user_cannot_reach_the_local_socket():
    if os.getuid() != 0:
        pytest.skip("needs root to run a process as another user")
    # The other user runs the system's Python (it may not read this checkout's venv).
    python = "/usr/bin/python3"
    if not os.path.exists(python):
        pytest.skip("no /usr/bin/python3 to run as another user")
    mq = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2)
    addr = mq.export_handle().local_subscribe_addr
    assert addr.startswith("ipc:///dev/shm/"), addr
    r = subprocess.run(
        [python, "-c", _CONNECT_AS_NOBODY, addr.removeprefix("ipc://")],
        capture_output=True,
        text=True,
        timeout=STEP,
        user=65534,
        cwd="/",
    )
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen["uid"] == 65534
    assert not seen["connected"], "another user connected to the queue's local socket"
    assert seen["error"] == "PermissionError", seen
    with pytest.raises(TimeoutError):
        mq.wait_until_ready(timeout=0.5)  # nobody counted


def test_the_same_local_rank_cannot_be_opened_twice_while_its_owner_lives(children):
    mq = MessageQueue(2, 2, max_chunk_bytes=1024, max_chunks=2)
    first = MessageQueue.create_from_handle(mq.export_handle(), 1)
    with pytest.raises(RuntimeError, match="held by another live process"):
        MessageQueue.create_from_handle(mq.export_handle(), 1)
    del first  # the owner goes: the rank is free again
    import gc

    gc.collect()
    again = MessageQueue.create_from_handle(mq.export_handle(), 1)
    assert again.local_reader_rank == 1


def test_a_rank_whose_owner_was_killed_can_be_opened_again(children):
    mq = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2)
    out = children.queue()
    owner = children.start(hold_rank, out, mq.export_handle(), 0)
    children.expect(out, "holding")
    with pytest.raises(RuntimeError, match="held by another live process"):
        MessageQueue.create_from_handle(mq.export_handle(), 0)
    owner.kill()
    owner.join(STEP)
    children.procs.remove(owner)
    reader = MessageQueue.create_from_handle(mq.export_handle(), 0)
    assert reader.local_reader_rank == 0


def test_a_view_kept_past_acquire_read_is_detached_from_the_chunk(children):
    # One chunk: the second message overwrites the first one's chunk. An array the
    # reader made from the first and kept must not change (it aliased the chunk before).
    mq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=1)
    out = children.queue()
    children.start(raw_chunk_keeper, out, mq.export_handle())
    mq.wait_until_ready(timeout=STEP)
    for fill in (1, 2):
        with mq.acquire_write(timeout=STEP) as buf:
            buf[:] = bytes([fill]) * len(buf)
    _, before, after, second = children.expect(out, "kept")
    assert second == [2] * 8, "the second chunk did not arrive"
    assert before == [1] * 8
    # The kept array still holds the view (numpy keeps a memoryview of it): it was given
    # a private copy when the block ended, and never shows the writer's second message.
    assert after == [1] * 8, f"a view kept past acquire_read shows the next message: {after}"
    children.join()


def test_a_view_released_at_the_end_of_acquire_read_is_retired():
    mq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=1)
    reader = MessageQueue.create_from_handle(mq.export_handle(), 0)
    with mq.acquire_write(timeout=STEP) as buf:
        buf[:4] = b"abcd"
    view = reader._reader.acquire_read(STEP)  # what the context manager gets
    with memoryview(view) as buf:
        assert bytes(buf[:4]) == b"abcd"
    reader._reader.finish_read()
    # Nothing held it: no new buffer can be made from it (its bytes are zeros now).
    with pytest.raises(BufferError, match="given back"):
        memoryview(view)
