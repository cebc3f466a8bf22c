"""What ``test_vllm_compat.py`` and ``test_vllm_plugin.py`` run in other processes.

Children are spawned and report through a ``multiprocessing`` queue, as in
``_processes`` (whose ``Children`` manager the tests use): every entry point lives at
module level, and every blocking call has a timeout (``STEP``).
"""

from __future__ import annotations

import gc
import logging
import os
from typing import Any

from _processes import STEP, _join_group

# ---------------------------------------------------------------------------------
# Object store


def signed_reader(out: Any, handle: Any, cmds: Any) -> None:
    """A reader of the store of ``handle``, driven by commands:
    ``("get", tag, address, id, signature, key)``, ``("touch", tag, key, address, id,
    signature)`` → ``("ok", tag, value)`` or ``("raised", tag, type, message)``;
    ``("count", tag, address, id)`` → the object's reader count; ``("secret", tag)``;
    ``("clear", tag)``; ``("stop",)``."""
    from shmq import ObjectStorage

    store = ObjectStorage.create_from_handle(handle)
    out.put(("ready", os.getpid()))
    while True:
        cmd = cmds.get(timeout=STEP)
        op = cmd[0]
        if op == "stop":
            break
        try:
            if op == "get":
                value: Any = store.get(*cmd[2:])
            elif op == "touch":
                value = store.touch(*cmd[2:])
            elif op == "count":
                value = store.reader_count(*cmd[2:])
            elif op == "secret":
                value = store.ring_buffer.get_auth_secret()
            elif op == "clear":
                value = store.clear()
            else:
                raise ValueError(f"unknown command {cmd!r}")
            out.put(("ok", cmd[1], value))
        except Exception as e:  # reported: the test decides
            out.put(("raised", cmd[1], type(e).__name__, str(e)))
    store.close()
    del store
    gc.collect()
    out.put(("stopped", os.getpid()))


# ---------------------------------------------------------------------------------
# Broadcast queue


def vllm_style_reader(out: Any, handle: Any, rank: int) -> None:
    """A reader that calls the queue as vLLM 0.33 does: ``dequeue(timeout, indefinite)``
    positionally, ``acquire_read(timeout, indefinite)``; reports what it read and the
    vLLM attributes it saw."""
    from shmq import MessageQueue

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    got = [mq.dequeue(STEP, True), mq.dequeue(STEP, False), mq.dequeue(timeout=STEP, indefinite=True)]
    with mq.acquire_read(STEP, True) as buf:
        got.append(bytes(buf[:5]))
    buf = mq.buffer
    attrs = {
        "metadata_size": buf.metadata_size,
        "data_offset": buf.data_offset,
        "metadata_offset": buf.metadata_offset,
        "total_bytes_of_buffer": buf.total_bytes_of_buffer,
        "shared_memory_name": buf.shared_memory.name,
        "handle_name": buf.handle()[3],
        "tensor_arena": mq.tensor_arena,
        "enable_shm_tensor_arena": mq.enable_shm_tensor_arena,
    }
    out.put(("read", got, attrs))


def env_probe(out: Any, env: dict[str, str]) -> None:
    """Report the connect address shmq picks with ``env`` (and no other SHMQ_/VLLM_
    address variable) set."""
    for name in ("SHMQ_HOST_IP", "VLLM_HOST_IP"):
        os.environ.pop(name, None)
    os.environ.update(env)
    from shmq import _core

    out.put(("ip", _core.default_connect_ip()))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.levelno, record.getMessage()))


def vllm_warning_interval_reader(out: Any, handle: Any, rank: int, env: dict[str, str]) -> None:
    """With ``env`` set (and shmq's own interval variable unset), report the shmq
    warnings logged during a ``dequeue(timeout=1)`` with nothing sent."""
    from shmq import MessageQueue

    os.environ.pop("SHMQ_RINGBUFFER_WARNING_INTERVAL", None)
    os.environ.update(env)  # before the first wait: the interval is read once
    capture = _Records()
    logging.getLogger().addHandler(capture)
    logging.getLogger().setLevel(logging.DEBUG)
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=STEP)
    try:
        mq.dequeue(timeout=1.0)
    except TimeoutError:
        pass
    out.put(("log", [r for r in capture.records if r[0].startswith("shmq") and r[1] >= logging.WARNING]))


# ---------------------------------------------------------------------------------
# Process groups


def single_reader_member(out: Any, port: int, rank: int, world_size: int, reader_rank: int, release: Any) -> None:
    """vLLM 0.33's ``create_from_process_group_single_reader`` over a stateless group:
    every rank makes a writer read by ``reader_rank``; the reader opens them all from the
    gathered handles and receives one message from each."""
    from shmq import MessageQueue

    pg = _join_group("stateless", port, rank, world_size)
    mq, handles = MessageQueue.create_from_process_group_single_reader(pg, 1 << 16, 2, reader_rank=reader_rank)
    report: dict[str, Any] = {"rank": rank, "n_handles": len(handles), "n_local_reader": mq.n_local_reader}
    readers = [MessageQueue.create_from_handle(h, 0) for h in handles]  # [] but on the reader
    mq.wait_until_ready(timeout=STEP)  # this rank's writer: its one reader has subscribed
    for r in readers:
        r.wait_until_ready(timeout=STEP)
    mq.enqueue(("from", rank), timeout=STEP)
    report["got"] = [r.dequeue(timeout=STEP) for r in readers]
    out.put(("done", report))
    if not release.wait(STEP):
        raise TimeoutError("the test never released the group")


def external_writer_member(out: Any, port: int, rank: int, world_size: int, handle: Any, release: Any) -> None:
    """vLLM 0.33's ``create_from_process_group(..., external_writer_handle=...)``: the
    queue's writer is the test process; every rank of the group (the group's writer rank
    included) becomes one of its readers."""
    from shmq import MessageQueue

    pg = _join_group("stateless", port, rank, world_size)
    mq = MessageQueue.create_from_process_group(
        pg, 1 << 16, 2, writer_rank=1, external_writer_handle=handle, blocking=False
    )
    mq.wait_until_ready(timeout=STEP)
    out.put(("got", rank, mq.export_handle() == handle, [mq.dequeue(timeout=STEP) for _ in range(3)]))
    if not release.wait(STEP):
        raise TimeoutError("the test never released the group")


def stateless_tensor_member(out: Any, port: int, rank: int, world_size: int, release: Any) -> None:
    """vLLM 0.33's tensor helpers of StatelessProcessGroup; rank 0 serves the store on a
    socket it bound itself (``listen_socket``)."""
    import socket

    import torch

    from shmq import StatelessProcessGroup

    listen = None
    if rank == 0:
        listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listen.bind(("127.0.0.1", port))
        listen.listen()
    pg = StatelessProcessGroup.create("127.0.0.1", port, rank, world_size, store_timeout=int(STEP), listen_socket=listen)
    seen: dict[str, Any] = {}
    seen["broadcast"] = pg.broadcast(torch.arange(4) * 10 if rank == 1 else None, src=1).tolist()
    if rank == 0:
        pg.send(torch.full((3,), 7.0), dst=2)
    if rank == 2:
        into = torch.zeros(3)
        got = pg.recv(into, src=0)
        seen["recv"] = (got.tolist(), got is into)
    mine = torch.tensor([float(rank + 1), float(-rank)])
    seen["sum"] = pg.all_reduce(mine).tolist()
    seen["max"] = pg.all_reduce(mine, op=torch.distributed.ReduceOp.MAX).tolist()
    seen["product"] = pg.all_reduce(mine, op=torch.distributed.ReduceOp.PRODUCT).tolist()
    pg.barrier(timeout=STEP)
    out.put(("seen", rank, seen))
    if not release.wait(STEP):
        raise TimeoutError("the test never released the group")

