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
55's one H100 run: 4.9-5.7 GB/s against 49-54 GB/s; not measured again here), and the
registered-mapping device path that would make views as fast is not built yet.
``SHMQ_DEVICE_PATH=1`` keeps the views. vLLM's ``PIN_MEMORY`` alone is not taken as a
GPU: a CUDA build of torch says True on a machine without one.

    from shmq import ObjectStorage
    from shmq.vllm_serde import VllmMsgpackSerde
    store = ObjectStorage(1 << 20, 1, ring, serde_class=VllmMsgpackSerde)

Importing it imports vLLM.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

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
