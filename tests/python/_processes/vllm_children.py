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

from _processes import STEP
from _processes.harness import LogRecords
from _processes.group_children import _join_group

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


def ring_memory_writer(out: Any, handle: Any, pattern: bytes) -> None:
    """Open the ``ShmRingBuffer`` of ``handle``, write ``pattern`` at the start of chunk
    1's data through ``get_data``, and report the segment's ``shared_memory`` size and
    what its ``buf`` shows there."""
    from shmq import ShmRingBuffer

    ring = ShmRingBuffer(*handle)
    with ring.get_data(1) as data:
        data[: len(pattern)] = pattern
    sm = ring.shared_memory
    buf = sm.buf
    assert buf is not None
    out.put(("written", sm.size, len(buf), bytes(buf).find(pattern)))


def env_probe(out: Any, env: dict[str, str]) -> None:
    """Report the connect address shmq picks with ``env`` (and no other SHMQ_/VLLM_
    address variable) set."""
    for name in ("SHMQ_HOST_IP", "VLLM_HOST_IP"):
        os.environ.pop(name, None)
    os.environ.update(env)
    from shmq import _core

    out.put(("ip", _core.default_connect_ip()))


def vllm_warning_interval_reader(out: Any, handle: Any, rank: int, env: dict[str, str]) -> None:
    """With ``env`` set (and shmq's own interval variable unset), report the shmq
    warnings logged during a ``dequeue(timeout=1)`` with nothing sent."""
    from shmq import MessageQueue

    os.environ.pop("SHMQ_RINGBUFFER_WARNING_INTERVAL", None)
    os.environ.update(env)  # before the first wait: the interval is read once
    capture = LogRecords()
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


def single_reader_member(
    out: Any, port: int, rank: int, world_size: int, reader_rank: int, same_node: Any, release: Any
) -> None:
    """vLLM 0.33's ``create_from_process_group_single_reader`` over a stateless group:
    every rank makes a writer read by ``reader_rank`` (local where ``same_node`` says so,
    when given); the reader opens them all from the gathered handles as vLLM's
    multi-node executor does (rank 0 where the handle has a local reader, -1 where only a
    remote one) and receives one message from each."""
    from shmq import MessageQueue

    pg = _join_group("stateless", port, rank, world_size)
    mq, handles = MessageQueue.create_from_process_group_single_reader(
        pg, 1 << 16, 2, reader_rank=reader_rank, same_node=same_node
    )
    report: dict[str, Any] = {"rank": rank, "n_handles": len(handles), "n_local_reader": mq.n_local_reader}
    # [] but on the reader
    readers = [MessageQueue.create_from_handle(h, 0 if h.local_reader_ranks else -1) for h in handles]
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
    pg = StatelessProcessGroup.create(
        "127.0.0.1", port, rank, world_size, store_timeout=int(STEP), listen_socket=listen
    )
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


# ---------------------------------------------------------------------------------
# vLLM itself, with the plugin (test_vllm_plugin.py)


def _vllm_config(world_size: int) -> Any:
    """The parts of a ``VllmConfig`` that vLLM's shared-memory multimodal cache reads."""
    from types import SimpleNamespace

    mm = SimpleNamespace(mm_processor_cache_gb=4 / 1024, mm_shm_cache_max_object_size_mb=1)
    return SimpleNamespace(
        parallel_config=SimpleNamespace(world_size=world_size),
        model_config=SimpleNamespace(get_multimodal_config=lambda: mm),
    )


def _mm_item(seed: int) -> Any:
    import torch

    from vllm.multimodal.inputs import MultiModalFieldElem, MultiModalKwargsItem, MultiModalSharedField

    pixels = torch.arange(seed * 1000, seed * 1000 + 3 * 32 * 17, dtype=torch.float32).reshape(3, 32, 17)
    elem = MultiModalFieldElem(data=pixels, field=MultiModalSharedField(batch_size=1))
    return MultiModalKwargsItem({"pixel_values": elem})


def vllm_member(
    out: Any,
    port: int,
    store_port: int,
    rank: int,
    world_size: int,
    enabled: bool,
    store_name: str,
    lock: Any,
    release: Any,
) -> None:
    """One process of a vLLM deployment in miniature, run by vLLM's own code:

    - before vLLM loads its plugins, it imports ``vllm.multimodal.cache.shm``, which binds
      ``SingleWriterShmRingBuffer``/``SingleWriterShmObjectStorage`` at load time;
    - ``vllm.plugins.load_general_plugins()`` runs the entry points (shmq's among them);
    - vLLM's ``GroupCoordinator`` (gloo, CPU) builds its broadcast queue
      (``use_message_queue_broadcaster``) through ``MessageQueue.create_from_process_group``;
    - rank 0 is the API server's multimodal cache (``ShmObjectStoreSenderCache``, the
      store's writer), the others are workers (``ShmObjectStoreReceiverCache``, readers);
      the sender's address items go to the workers through the coordinator's queue
      (``broadcast_object``), twice for the same image (a cache hit the second time);
    - vLLM's own ``StatelessProcessGroup`` is handed to the queue class vLLM's module
      names (``shm_broadcast.MessageQueue.create_from_process_group``).

    Reports the classes vLLM ended up using, what the workers read, the plugin's log
    lines, and whether the image could be evicted once every worker had fetched it."""
    import logging

    os.environ.pop("SHMQ_VLLM", None)
    if enabled:
        os.environ["SHMQ_VLLM"] = "1"
    os.environ["VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME"] = store_name  # where vLLM puts its cache
    # vLLM's msgpack decoder pins the memory of out-of-band tensors, which this CUDA
    # build of torch cannot do without a GPU driver: keep the test's tensors in band.
    os.environ["VLLM_MSGPACK_ZERO_COPY_THRESHOLD"] = str(1 << 20)
    import torch
    import torch.distributed as dist

    import vllm.multimodal.cache.shm as mm_shm  # binds the store's names at load time
    from vllm.plugins import load_general_plugins

    # Rank 0 has vLLM's logging set up (an INFO handler on the "vllm" logger, as its
    # engine processes do); the others load plugins before any logging set-up (as its
    # API server does), where the plugin writes its line to stderr.
    import io
    import sys

    capture = LogRecords()
    stderr, sys.stderr = sys.stderr, io.StringIO()
    if rank == 0:
        logging.getLogger("vllm").setLevel(logging.INFO)
        logging.getLogger("vllm").addHandler(capture)
    try:
        load_general_plugins()
    finally:
        written, sys.stderr = sys.stderr.getvalue(), stderr
        logging.getLogger("vllm").removeHandler(capture)
    plugin_lines = [m for _, _, m in capture.records if "shmq" in m]
    plugin_lines += [line for line in written.splitlines() if "shmq" in line]
    from vllm.distributed.device_communicators import shm_broadcast, shm_object_storage
    from vllm.distributed.parallel_state import GroupCoordinator
    from vllm.distributed.utils import StatelessProcessGroup

    report: dict[str, Any] = {
        "rank": rank,
        "log": plugin_lines,
        "log_via_logging": bool(capture.records),
        "module_classes": {
            "MessageQueue": shm_broadcast.MessageQueue.__module__,
            "Handle": shm_broadcast.Handle.__module__,
            "ShmRingBuffer": shm_broadcast.ShmRingBuffer.__module__,
            "SingleWriterShmRingBuffer": shm_object_storage.SingleWriterShmRingBuffer.__module__,
            "SingleWriterShmObjectStorage": shm_object_storage.SingleWriterShmObjectStorage.__module__,
            "ShmObjectStorageHandle": shm_object_storage.ShmObjectStorageHandle.__module__,
        },
        "load_time_binding": mm_shm.SingleWriterShmObjectStorage.__module__,
    }
    # Across nodes: vLLM's locality rule, and a lost worker node an error (the watch of
    # worker nodes needs vLLM's executor module, which this venv's vLLM without its heavy
    # dependencies cannot import: the engine tests check it).
    import shmq.group

    report["multinode"] = (shmq.group.locality_rule is not None, shmq.MessageQueue.default_on_lost_remote_reader)
    _join_group("gloo", port, rank, world_size)
    coordinator = GroupCoordinator(
        group_ranks=[list(range(world_size))],
        local_rank=rank,
        torch_distributed_backend="gloo",
        use_device_communicator=False,
        use_message_queue_broadcaster=True,
        group_name="shmq_plugin_test",
    )
    report["queue_class"] = type(coordinator.mq_broadcaster).__module__
    config = _vllm_config(world_size - 1)  # the workers are the store's readers
    hashes = ["image-a", "image-b", "image-a"]  # image-a again: a cache hit
    if rank == 0:
        cache = mm_shm.ShmObjectStoreSenderCache(config)
        report["store_class"] = type(cache._shm_cache).__module__
        dist.barrier()  # as in vLLM, the sender's store exists before the workers open it
        items = {h: _mm_item(i) for i, h in enumerate(dict.fromkeys(hashes))}
        for h in hashes:
            address_item, _ = cache.get_and_update_item((items[h], []), h)
            coordinator.broadcast_object((h, address_item), src=0)
        report["sent"] = {h: items[h]["pixel_values"].data.sum().item() for h in items}
        report["hits"] = cache.make_stats().hits
        dist.barrier()  # every worker has fetched every item
        store = cache._shm_cache
        report["cached_before_eviction"] = sorted(store.key_index)
        store.free_unused()
        report["cached_after_eviction"] = sorted(store.key_index)
    else:
        dist.barrier()
        cache = mm_shm.ShmObjectStoreReceiverCache(config, lock)
        report["store_class"] = type(cache._shm_cache).__module__
        got = []
        for _ in hashes:
            h, address_item = coordinator.broadcast_object(None, src=0)
            cache.touch_receiver_cache_item(h, address_item)
            item = cache.get_and_update_item(address_item, h)
            got.append((h, item["pixel_values"].data.sum().item(), tuple(item["pixel_values"].data.shape)))
        report["got"] = got
        dist.barrier()
    dist.barrier()  # the writer has checked eviction before it closes the store
    if rank == 0:
        cache.close()  # vLLM's sender cache closes its store; the receivers' have no close

    # vLLM's own StatelessProcessGroup, through vLLM's module name for the queue.
    pg = StatelessProcessGroup.create("127.0.0.1", store_port, rank, world_size, store_timeout=int(STEP))
    mq = shm_broadcast.MessageQueue.create_from_process_group(pg, 1 << 16, 2, writer_rank=1)
    if rank == 1:
        for i in range(3):
            mq.enqueue(torch.full((4,), float(i)), timeout=STEP)
    else:
        report["stateless"] = [mq.dequeue(timeout=STEP).tolist() for _ in range(3)]
    report["stateless_queue_class"] = type(mq).__module__
    pg.barrier(timeout=STEP)
    out.put(("report", report))
    if not release.wait(STEP):
        raise TimeoutError("the test never released the group")
    del mq, coordinator
    dist.destroy_process_group()


def vllm_plugin_off(out: Any) -> None:
    """Without SHMQ_VLLM: vLLM loads shmq's plugin, which does nothing."""
    import logging

    os.environ.pop("SHMQ_VLLM", None)
    from vllm.plugins import load_general_plugins

    import io
    import sys

    capture = LogRecords()
    logging.getLogger("vllm").setLevel(logging.DEBUG)
    logging.getLogger("vllm").addHandler(capture)
    stderr, sys.stderr = sys.stderr, io.StringIO()
    try:
        load_general_plugins()
    finally:
        written, sys.stderr = sys.stderr.getvalue(), stderr
    from importlib.metadata import entry_points

    from vllm.distributed.device_communicators import shm_broadcast, shm_object_storage

    import shmq.vllm_plugin

    out.put(
        (
            "off",
            {
                "entry_points": [e.value for e in entry_points(group="vllm.general_plugins")],
                "MessageQueue": shm_broadcast.MessageQueue.__module__,
                "SingleWriterShmObjectStorage": shm_object_storage.SingleWriterShmObjectStorage.__module__,
                "active": shmq.vllm_plugin.is_active(),
                # What shmq's plugin said (vLLM itself lists the plugins it found at DEBUG).
                "log": [m for name, _, m in capture.records if name == "vllm.plugins.shmq"]
                + [w for w in written.splitlines() if "shmq" in w],
            },
        )
    )


# ---------------------------------------------------------------------------------
# shmq's encoder-cache connector (shmq.vllm_ec_connector) over vLLM's ECConnectorBase


def ec_config(role: str, name: str, **extra: Any) -> Any:
    """A stand-in for vLLM's config with a real ``ECTransferConfig`` naming shmq's
    connector (the connector reads nothing else of it)."""
    from types import SimpleNamespace

    from vllm.config import ECTransferConfig

    ec = ECTransferConfig(
        ec_connector="ShmqECConnector",
        ec_connector_module_path="shmq.vllm_ec_connector",
        ec_role=role,
        ec_connector_extra_config={"name": name, **extra},
    )
    return SimpleNamespace(ec_transfer_config=ec, model_config=None)


def ec_worker(out: Any, cmds: Any, role: str, name: str, extra: dict) -> None:
    """A worker's side of the connector, driven by commands: ``("save", key, value)`` →
    ``("saved", key, saved count)``; ``("load", metadata)`` → ``("loaded", {key: (sum,
    shape, is a view of shared memory)})``; ``("stop",)``."""
    import torch
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from shmq.vllm_ec_connector import ShmqECConnector

    connector = ShmqECConnector(ec_config(role, name, **extra), ECConnectorRole.WORKER)
    out.put(("ready", os.getpid()))
    while True:
        cmd = cmds.get(timeout=4 * STEP)  # siblings importing vLLM meanwhile take a while
        if cmd[0] == "stop":
            break
        if cmd[0] == "save":
            connector.save_caches({cmd[1]: cmd[2]}, cmd[1])
            connector.wait_for_save()
            out.put(("saved", cmd[1], connector.stats()["saved"]))
        elif cmd[0] == "load":
            cache: dict[str, Any] = {}
            connector.bind_connector_metadata(cmd[1])
            connector.start_load_caches(cache)
            connector.clear_connector_metadata()
            got = {}
            for k, t in cache.items():
                assert isinstance(t, torch.Tensor)
                # A view of the cache's shared memory, not a copy: its storage is not
                # torch's own allocation.
                got[k] = (float(t.float().sum()), tuple(t.shape), not t.untyped_storage().resizable())
            out.put(("loaded", got))
    connector.shutdown()
    out.put(("stopped", os.getpid()))
