"""vLLM's multimodal items in shmq's store, their large tensors read as views.

Under the plugin, vLLM's multimodal processor cache (``mm_processor_cache_type="shm"``)
stores each item with this serde in place of vLLM's ``MsgpackSerde`` (the plugin
rebinds the name). It encodes exactly as vLLM's does (``MsgpackEncoder``: a msgpack tree
and the tensors' raw buffers), but gives the store those buffers as parts of their own,
so that a worker's read of a tensor of ``ObjectStorage.view_threshold`` bytes or more
is a view of the shared memory (a private copy-on-write mapping, see
:meth:`shmq.ObjectStorage.get`) rather than vLLM's decoder's copy. Smaller parts are
copied once, as vLLM's serde copies them. An item is not evicted while a view of it
lives in a worker; a writer that finds the cache full of such items gets
``MemoryError``, which vLLM's sender cache answers by sending the item inline, as it
does for any full cache.

Where torch sees a GPU, workers read items as vLLM alone does instead: vLLM's own
decoders (``share_mem=False``) make the copies, pinned where vLLM pins memory, straight
from the store's shared memory (no copy of shmq's before them), and hold nothing of the
store. A pageable view reaches a GPU at about a tenth of a pinned copy's speed (issue
55's one H100 run: 4.9-5.7 GB/s against 49-54 GB/s; not measured again here). vLLM's
``PIN_MEMORY`` alone is not taken as a GPU: a CUDA build of torch says True on a machine
without one.

``SHMQ_DEVICE_PATH=1`` switches on the device path instead (not yet run on a GPU, so off
by default): a worker's read puts each item's tensors on its current device itself,
copied from the worker's *shared* mapping of the store, registered with the device block by block
(``ObjectStorage.get(..., device=)``), the item held until the copies ended; fields vLLM
keeps on the CPU (``keep_on_cpu``) stay host views. vLLM's batching finds the data on
the device already and moves nothing. On a machine without a GPU, ``SHMQ_DEVICE=twin``
runs the same path against the CPU twin of the device (the tests).

    from shmq import ObjectStorage
    from shmq.vllm_serde import VllmMsgpackSerde
    store = ObjectStorage(1 << 20, 1, ring, serde_class=VllmMsgpackSerde)

Importing it imports vLLM.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Callable, Optional

from vllm.distributed.device_communicators.shm_object_storage import MsgpackSerde

from .serde import Buffer

# The first part says what the rest is: vLLM's tensor or item encoding, or a pickle.
_TENSOR, _ITEM, _PICKLE = b"T", b"M", b"P"


def _reads_copies() -> bool:
    """Whether this process reads items as vLLM alone does (its own decoders' copies,
    pinned where vLLM pins): where torch sees a GPU, unless ``SHMQ_DEVICE_PATH=1``."""
    if os.environ.get("SHMQ_DEVICE_PATH") == "1":
        return False
    import torch

    return bool(torch.cuda.is_available())


def _read_device() -> Optional[str]:
    """Where a read puts items' tensors under ``SHMQ_DEVICE_PATH=1``: this process's
    current CUDA device, or ``"cpu"`` with the CPU twin (``SHMQ_DEVICE=twin``); None
    (reads as views, or vLLM's copies) otherwise."""
    if os.environ.get("SHMQ_DEVICE_PATH") != "1":
        return None
    if os.environ.get("SHMQ_DEVICE", "").strip().lower() == "twin":
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        return None
    return f"cuda:{torch.cuda.current_device()}"


class VllmMsgpackSerde(MsgpackSerde):  # type: ignore[misc]  # vLLM's class is untyped here
    """vLLM's ``MsgpackSerde`` whose parts the store lays out itself (see the module)."""

    #: :func:`shmq.serde.store_codec`: this serde gives the store its parts.
    shmq_store_parts = True

    def __init__(self) -> None:
        super().__init__()
        from vllm.multimodal.inputs import MultiModalKwargsItem
        from vllm.v1.serial_utils import MsgpackDecoder
        import torch

        #: Reads make vLLM's own copies (see the module): on a machine with a GPU.
        self.copies = _reads_copies()
        if self.copies:
            # vLLM's decoders (share_mem=False): copies, pinned where vLLM pins.
            self._shared = {_TENSOR: self.tensor_decoder, _ITEM: self.mm_decoder}
        else:
            # share_mem: a tensor over a part the store handed out as owned (a view, or
            # a copy made for this read) keeps that part; vLLM's own decoders copy.
            self._shared = {
                _TENSOR: MsgpackDecoder(torch.Tensor, share_mem=True),
                _ITEM: MsgpackDecoder(MultiModalKwargsItem, share_mem=True),
            }
        self._tensor_cls = torch.Tensor

    def shmq_read_device(self) -> Optional[str]:
        """The device a plain ``get`` puts tensors on (``ObjectStorage.get``): see the
        module's ``SHMQ_DEVICE_PATH``."""
        return None if self.copies else _read_device()

    def shmq_device_leaves(self, value: Any, move: Callable[[Any], Any]) -> Any:
        """``value`` with ``move(tensor)`` for the tensors vLLM would put on the device: a
        tensor, or each field of an item but those vLLM keeps on the CPU."""
        if isinstance(value, self._tensor_cls):
            return move(value)
        if isinstance(value, self._mm_kwargs_item_cls):
            from vllm.multimodal.inputs import MultiModalFieldElem

            from ._device_reader import tensor_leaves

            return type(value)(
                {
                    key: elem
                    if elem.data is None or getattr(elem.field, "keep_on_cpu", False)
                    else MultiModalFieldElem(data=tensor_leaves(elem.data, move), field=elem.field)
                    for key, elem in value.items()
                }
            )
        return value

    def _store_parts(self, value: Any) -> list[Buffer]:
        if isinstance(value, self._tensor_cls):
            return [_TENSOR, *self.encoder.encode(value)]
        if isinstance(value, self._mm_kwargs_item_cls):
            return [_ITEM, *self.encoder.encode(value)]
        return [_PICKLE, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)]

    def _load_parts(self, parts: list[memoryview], raws_owned: bool = False) -> Any:
        head, *rest = parts
        kind = bytes(head)
        try:
            if kind == _PICKLE:
                return pickle.loads(rest[0])
            decoder = self._shared.get(kind)
            if decoder is None:
                raise ValueError(f"Unsupported object kind {kind!r} in shmq's store")
            if self.copies:
                # vLLM's decoders copy (and pin) straight from the parts, owned or not.
                return decoder.decode(rest)
            # Parts not owned (``copy=True``, or a store without views) are copied once
            # here, and the tensors keep the copies.
            return decoder.decode(rest if raws_owned else [bytearray(p) for p in rest])
        finally:
            # Parts that are not owned are views of shared memory: none outlives this call.
            rest.clear()
