"""vLLM's multimodal items through shmq's store with the plugin's serde
(:mod:`shmq.vllm_serde`): vLLM's own encoding, read by other processes with the large
tensors as views of the store (the item pinned while one lives, a reader's writes its
own), the small ones copied."""

from __future__ import annotations

import gc
import multiprocessing as mp

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.multimodal.inputs")

from shmq import ObjectStorage  # noqa: E402
from shmq.object_storage import RingBuffer  # noqa: E402

SIDE = 336  # a 336x336 image's pixel values: float32, 1.3 MiB, past view_threshold
MiB = 1 << 20


def _pixels(seed: int):
    return torch.arange(3 * SIDE * SIDE, dtype=torch.float32).reshape(3, SIDE, SIDE) + seed


def _item(seed: int):
    from vllm.multimodal.inputs import MultiModalFieldElem, MultiModalKwargsItem, MultiModalSharedField

    field = MultiModalSharedField(batch_size=1)
    return MultiModalKwargsItem(
        {
            "pixel_values": MultiModalFieldElem(data=_pixels(seed), field=field),
            "image_sizes": MultiModalFieldElem(data=torch.tensor([SIDE, SIDE + seed]), field=field),
        }
    )


def _reader(handle, jobs, answers, as_on_a_gpu: bool = False, device_path: bool = False) -> None:
    if device_path:
        # The plugin's device path (SHMQ_DEVICE_PATH=1) against the CPU twin of the device.
        import os

        os.environ["SHMQ_DEVICE_PATH"], os.environ["SHMQ_DEVICE"] = "1", "twin"
    if as_on_a_gpu:
        # What torch.cuda.is_available() says on a machine with a GPU (and what vLLM's
        # PIN_MEMORY would be): the serde makes vLLM's copies. Pinning itself is vLLM's
        # and needs a GPU; here the copies are plain ones.
        import shmq.vllm_serde
        import vllm.v1.serial_utils

        shmq.vllm_serde._reads_copies = lambda: True
        # vLLM's PIN_MEMORY says True with a CUDA build of torch, where pinning needs a
        # driver: the decoders copy without pinning here.
        vllm.v1.serial_utils.PIN_MEMORY = False
    store = ObjectStorage.create_from_handle(handle)
    held = []
    for job in iter(jobs.get, None):
        if job[0] == "drop":
            held.clear()
            gc.collect()
            answers.put("dropped")
            continue
        if job[0] == "check":  # the items held are still what was read
            answers.put([bool(torch.equal(i["pixel_values"].data.flatten()[1:], _pixels(s).flatten()[1:]))
                         for i, s in held])
            continue
        if job[0] == "device":  # what the device path did: registered, and which fields it copied
            registered = store._device is not None and bool(store._device.registrations)
            answers.put((registered, [sorted(k for k, e in i.items() if e.data.untyped_storage().resizable())
                                      for i, _ in held]))
            continue
        _, address, monotonic_id, signature, key, seed = job
        item = store.get(address, monotonic_id, signature, key)
        if device_path:
            store.wait_device_copies()  # a host read of the twin's copies: after they ended
        pixels, sizes = item["pixel_values"].data, item["image_sizes"].data
        same = bool(torch.equal(pixels, _pixels(seed))) and sizes.tolist() == [SIDE, SIDE + seed]
        pixels[0, 0, 0] = -1.0  # a private copy-on-write page: nobody else sees it
        held.append((item, seed))
        answers.put((type(item).__name__, same))
        del item, pixels, sizes
    answers.put("done")


class _TwoReaders:
    """A store of room for two items, with the plugin's serde, and two reader processes
    (``_reader``; ``as_on_a_gpu`` and ``device_path`` as they say) asked by job queues. ``read(seed)`` asks
    both for image ``seed`` and checks what they read; ``ask(job)`` sends both a job and
    returns their answers. On exit every reader is told to end and has exited with 0."""

    def __init__(self, as_on_a_gpu: bool = False, device_path: bool = False):
        from shmq.vllm_serde import VllmMsgpackSerde

        self.ring = RingBuffer(3 * MiB, create=True)  # room for two items
        self.store = ObjectStorage(2 * MiB, 2, self.ring, serde_class=VllmMsgpackSerde)
        ctx = mp.get_context("spawn")
        self.jobs = [ctx.Queue() for _ in range(2)]
        self.answers = ctx.Queue()
        args = [(self.store.handle(), j, self.answers, as_on_a_gpu, device_path) for j in self.jobs]
        self.readers = [ctx.Process(target=_reader, args=a) for a in args]

    def __enter__(self) -> "_TwoReaders":
        for p in self.readers:
            p.start()
        return self

    def ask(self, job: tuple, timeout: float = 60) -> list:
        for j in self.jobs:
            j.put(job)
        return [self.answers.get(timeout=timeout) for _ in self.jobs]

    def read(self, seed: int) -> None:
        key = f"image-{seed}"
        address, monotonic_id = self.store.key_index[key]
        got = self.ask(("get", address, monotonic_id, self.store.get_signature(key), key, seed), timeout=120)
        assert got == [("MultiModalKwargsItem", True)] * 2, got

    def __exit__(self, *exc: object) -> None:
        for j in self.jobs:
            j.put(None)
        for p in self.readers:
            p.join(60)
        self.store.close()
        self.ring.close()
        if exc[0] is None:
            assert [p.exitcode for p in self.readers] == [0, 0]


def test_items_read_by_two_processes_as_views_pin_their_object_and_stay_private():
    with _TwoReaders() as two:
        store = two.store
        store.put("image-0", _item(0))
        two.read(0)
        store.put("image-1", _item(1))
        # image-2 would evict image-0, which both readers hold as views: refused as
        # vLLM's sender cache expects of a full cache (it then sends the item inline).
        with pytest.raises(MemoryError):
            store.put("image-2", _item(2))
        assert store.is_cached("image-0")
        # A reader's write stayed its own.
        mine = store.get(*store.key_index["image-0"], store.get_signature("image-0"), "image-0", copy=True)
        assert torch.equal(mine["pixel_values"].data, _pixels(0))
        assert two.ask(("drop",)) == ["dropped"] * 2
        store.put("image-2", _item(2))  # image-0 goes now
        assert not store.is_cached("image-0")
        two.read(2)


def test_on_a_cuda_machine_readers_make_vllms_copies_and_pin_nothing():
    """Where torch sees a GPU, the serde reads as vLLM alone does (its share_mem=False
    decoders' copies, pinned where vLLM pins): items held by the readers hold nothing of
    the store, so a put evicts them where, read as views, it was refused (the test
    above); the readers' copies are untouched by the eviction."""
    with _TwoReaders(as_on_a_gpu=True) as two:
        store = two.store
        store.put("image-0", _item(0))
        two.read(0)
        store.put("image-1", _item(1))
        two.read(1)
        store.put("image-2", _item(2))  # evicts image-0, held by both readers as copies
        assert not store.is_cached("image-0")
        store.put("image-3", _item(3))  # and image-1, whose room is written over
        assert two.ask(("check",)) == [[True, True]] * 2  # image-0 and image-1
        two.read(3)


def test_the_device_path_copies_items_from_the_registered_store_and_pins_nothing():
    """``SHMQ_DEVICE_PATH=1`` (here against the CPU twin of the device): a worker's read
    puts each item's tensors on its device itself, copied from its registered shared
    mapping of the store; once the copies ended the items hold nothing of the store, so
    puts evict them, and the readers' copies stay as read. A field vLLM keeps on the CPU
    stays a host view (and so holds its item until dropped)."""
    from vllm.multimodal.inputs import MultiModalFieldElem, MultiModalSharedField

    with _TwoReaders(device_path=True) as two:
        store = two.store
        store.put("image-0", _item(0))
        two.read(0)
        store.put("image-1", _item(1))
        two.read(1)
        # Copies, registered: every field of both items (none is a view of the store).
        assert two.ask(("device",)) == [(True, [["image_sizes", "pixel_values"]] * 2)] * 2
        store.put("image-2", _item(2))  # evicts image-0, held by both readers as copies
        assert not store.is_cached("image-0")
        store.put("image-3", _item(3))  # and image-1, whose room is written over
        assert two.ask(("check",)) == [[True, True]] * 2
        two.read(2)
        two.read(3)
        assert two.ask(("drop",)) == ["dropped"] * 2
        # A field kept on the CPU: a view, the others copied.
        kept = _item(4)
        kept["pixel_values"] = MultiModalFieldElem(
            data=_pixels(4), field=MultiModalSharedField(batch_size=1, keep_on_cpu=True)
        )
        store.put("image-4", kept)
        two.read(4)
        assert two.ask(("device",)) == [(True, [["image_sizes"]])] * 2
