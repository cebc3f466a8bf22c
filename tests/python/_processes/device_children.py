"""Children of the device tests (``test_device_*.py``): a store reader, a queue reader and
an encoder-cache consumer that receive into device memory through the device seam
(``SHMQ_DEVICE``: the CPU twin unless set to ``cuda``), each driven by commands from the
test (``DeviceChild``), and an IPC exporter."""

from __future__ import annotations

import logging
import os
import pickle
import threading
from typing import Any

from .harness import STEP, LogRecords

#: The seam the tests run against: the twin here, CUDA under scripts/gpu_check.sh.
SEAM = os.environ.get("SHMQ_DEVICE", "twin")
#: Where tensors land: the twin's device memory is process memory.
DEVICE = "cuda" if SEAM == "cuda" else "cpu"


def to_host(value: Any) -> Any:
    """``value`` with its tensors copied to host memory (torch), for the test to compare."""
    import torch

    from shmq._device_reader import tensor_leaves

    return tensor_leaves(value, lambda t: t.detach().to("cpu").clone() if isinstance(t, torch.Tensor) else t)


class DeviceChild:
    """The test's side of a driven child: starts ``target(out, *args, cmds)``, waits for
    its ``("ready", pid)``; ``ask(*cmd)`` sends a command and returns the answer;
    ``stop()`` ends it and checks it exited 0."""

    def __init__(self, children: Any, target: Any, *args: Any):
        self.children, self.out, self.cmds = children, children.queue(), children.queue()
        self.proc = children.start(target, self.out, *args, self.cmds)
        self.pid = children.expect(self.out, "ready")[1]

    def ask(self, *cmd: Any) -> Any:
        self.cmds.put(cmd)
        return self.children.receive(self.out)

    def stop(self) -> None:
        assert self.ask("stop")[0] == "stopped"
        self.proc.join(10)
        assert self.proc.exitcode == 0


class _Answers:
    """The commands every driven child answers alike, over the values it received:
    ``release`` (the twin's held copies go), ``wait`` (waits for the copies, reports the
    values and the copies still in flight), ``close_async`` / ``closed`` (``close`` on a
    thread while copies may be in flight, then its end and the seam's registrations)."""

    def __init__(self, out: Any, seam: Any, wait: Any, in_flight: Any, close: Any = None):
        self.out, self.seam, self.wait, self.in_flight, self.close = out, seam, wait, in_flight, close
        self.values: list[Any] = []
        self.closer: threading.Thread | None = None

    def __call__(self, cmd: tuple) -> bool:
        """Answer ``cmd`` if it is one of these; whether it was."""
        out = self.out
        if cmd[0] == "release":
            self.seam.release()
            out.put(("released",))
        elif cmd[0] == "wait":
            self.wait()
            out.put(("values", [to_host(v) for v in self.values], self.in_flight()))
            self.values.clear()
        elif cmd[0] == "close_async" and self.close is not None:
            self.closer = threading.Thread(target=self.close)
            self.closer.start()
            self.closer.join(0.5)
            out.put(("closing", self.closer.is_alive()))
        elif cmd[0] == "closed":
            assert self.closer is not None
            self.closer.join(STEP)
            out.put(("closed", self.closer.is_alive(), [to_host(v) for v in self.values],
                     [repr(r) for r in getattr(self.seam, "_registered", [])]))
            self.values.clear()
        else:
            return False
        return True


def device_reader(out: Any, handle_blob: bytes, cmds: Any) -> None:
    """A store reader: ``("get", handle, hold)`` reads to device memory (with ``hold``, the
    twin's copies stay in flight until ``("release",)``); ``("wait",)`` waits for the
    copies and reports the values; ``("preregister",)`` registers the store's mapping
    itself first, so that the store's own registration is refused; ``("close_async",)``
    closes the store on a thread while copies may be in flight."""
    from shmq import ObjectStorage
    from shmq._device import address_of, device_for

    records = LogRecords()
    logging.getLogger("shmq.device").addHandler(records)
    seam = device_for(SEAM)
    store = ObjectStorage.create_from_handle(pickle.loads(handle_blob))
    store.device_seam = seam
    answers = _Answers(out, seam, store.wait_device_copies, store.release_device_copies, store.close)
    mine: Any = None
    out.put(("ready", os.getpid()))
    while True:
        cmd = cmds.get(timeout=STEP)
        if answers(cmd):
            continue
        if cmd[0] == "get":
            _, handle, hold = cmd
            if hold:
                seam.hold()  # type: ignore[attr-defined]
            answers.values.append(store.get(*handle, device=DEVICE))
            out.put(("issued", len(store._device.pending) if store._device else 0))
        elif cmd[0] == "preregister":
            buf = store.ring_buffer.shared_memory.buf
            assert buf is not None
            mine = seam.register(address_of(buf), buf.nbytes, buf.readonly)
            out.put(("preregistered", repr(mine)))
        elif cmd[0] == "logs":
            out.put(("logs", [r for r in records.records if r[0] == "shmq.device"],
                     store._device.refused if store._device else None))
        elif cmd[0] == "stop":
            if mine is not None:
                seam.unregister(mine)  # before the mapping goes
            store.close()
            out.put(("stopped",))
            return


def ipc_exporter(out: Any, cmds: Any) -> None:
    """Export a device tensor by IPC handle, change it when told, free it when told."""
    import torch

    from .device_children import DEVICE, SEAM
    from shmq._device import device_for

    seam = device_for(SEAM)
    tensor = torch.arange(1 << 16, dtype=torch.int32, device=DEVICE)
    out.put(("handle", seam.export_ipc(tensor)))
    assert cmds.get(timeout=STEP) == "change"
    tensor += 1
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    out.put(("changed",))
    assert cmds.get(timeout=STEP) == "stop"
    del tensor
    out.put(("stopped",))


def queue_device_reader(out: Any, handle: Any, rank: int, cmds: Any) -> None:
    """A queue reader that receives into device memory: ``("recv", hold)`` dequeues one
    message with ``device=`` (with ``hold``, the twin's copies stay in flight until
    ``("release",)``); ``("wait",)`` waits for the copies and reports the values;
    ``("preregister",)`` dequeues one message on the host path and registers the arena's
    shared mapping itself (from that message's view), so that the queue's own
    registration is refused; ``("close_async",)`` closes the device path on a thread
    while copies may be in flight."""
    from shmq import MessageQueue, _core
    from shmq._device import address_of, device_for

    records = LogRecords()
    logging.getLogger("shmq.device").addHandler(records)
    seam = device_for(SEAM)
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.device_seam = seam
    mq.wait_until_ready(timeout=STEP)
    answers = _Answers(out, seam, mq.wait_device_copies, mq.release_device_copies, mq.close_device)
    mine: Any = None
    out.put(("ready", os.getpid()))
    while True:
        cmd = cmds.get(timeout=STEP)
        if answers(cmd):
            continue
        if cmd[0] == "recv":
            if cmd[1]:
                seam.hold()  # type: ignore[attr-defined]
            answers.values.append(mq.dequeue(timeout=STEP, device=DEVICE))
            out.put(("issued", mq.release_device_copies()))
        elif cmd[0] == "preregister":
            reader = mq._reader
            assert reader is not None
            message = reader.dequeue(STEP, None, False)
            assert isinstance(message, _core.PartsMessage)
            body, buffers = message.body, message.buffers
            mapping, _ = buffers[0].obj.shared_source()
            view = memoryview(mapping)
            mine = (seam.register(address_of(view), view.nbytes, view.readonly), view)
            del body, buffers, message
            out.put(("preregistered", repr(mine[0])))
        elif cmd[0] == "logs":
            out.put(("logs", [r for r in records.records if r[0] == "shmq.device"]))
        elif cmd[0] == "blocks":  # the registered blocks of each mapping, and their size
            readers = mq._device._readers.values() if mq._device is not None else []
            out.put(("blocks", [(r.block, sorted(r.registrations)) for r in readers]))
        elif cmd[0] == "stop":
            mq.close_device()
            if mine is not None:
                seam.unregister(mine[0])  # before the mapping goes
            out.put(("stopped",))
            return


def cache_device_consumer(out: Any, name: str, cmds: Any) -> None:
    """An encoder-cache consumer that loads into device memory: ``("get", key, hold)``
    (with ``hold``, the twin's copies stay in flight until ``("release",)``); ``("wait",)``
    reports the values; ``("break_ipc",)`` makes every IPC handle fail to open here (as
    a consumer that cannot see the producer's device); ``("opened",)`` how many handles
    are open; ``("logs",)``."""
    from shmq import EncoderCacheConsumer
    from shmq._device import device_for

    records = LogRecords()
    logging.getLogger("shmq").addHandler(records)
    seam = device_for(SEAM)
    consumer = EncoderCacheConsumer(name, device_seam=seam)
    answers = _Answers(out, seam, consumer.wait_device_copies, consumer.release_device_copies)
    out.put(("ready", os.getpid()))
    while True:
        cmd = cmds.get(timeout=STEP)
        if answers(cmd):
            continue
        if cmd[0] == "get":
            _, key, hold = cmd
            if hold:
                seam.hold()  # type: ignore[attr-defined]
            got: dict = {}
            missing = consumer.load([key], got, device=DEVICE)
            answers.values.append(got.get(key))
            out.put(("issued", consumer.release_device_copies(), missing))
        elif cmd[0] == "break_ipc":
            def refuse(handle: Any) -> Any:
                raise RuntimeError("this consumer cannot open that handle")

            seam.open_ipc = refuse  # type: ignore[method-assign]
            out.put(("broken",))
        elif cmd[0] == "opened":
            out.put(("opened", consumer.opened_handles()))
        elif cmd[0] == "registered":  # blocks registered, over every producer's mapping
            readers = consumer._device._readers.values() if consumer._device is not None else []
            out.put(("registered", sum(len(r.registrations) for r in readers)))
        elif cmd[0] == "logs":
            out.put(("logs", [r for r in records.records if r[0].startswith("shmq")]))
        elif cmd[0] == "stop":
            consumer.close()
            out.put(("stopped",))
            return


def queue_plain_reader(out: Any, handle: Any, rank: int, n: int, device: Any, cmds: Any) -> None:
    """Dequeue ``n`` messages (with ``device``, if not None, against the twin) and report
    each as host values, with the IPC allocations this process has open; then wait for
    ``"stop"`` (the tensors sent back are torch's shared memory, which the test receives
    from this process while it lives)."""
    from shmq import MessageQueue
    from shmq._device import device_for
    from shmq._ipc import open_handles

    mq = MessageQueue.create_from_handle(handle, rank)
    mq.device_seam = device_for(SEAM)
    mq.wait_until_ready(timeout=STEP)
    got = []
    for _ in range(n):
        value = mq.dequeue(timeout=STEP, device=device)
        mq.wait_device_copies()
        got.append(to_host(value))
    out.put(("got", got, open_handles()))
    mq.close_device()
    assert cmds.get(timeout=STEP) == "stop"
