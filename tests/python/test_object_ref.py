"""One picklable reference per stored object (issue 59 item 5), in real processes: the
writer's ``put_ref`` / ``ref`` return an ``ObjectRef``, which travels to a reader process
(pickled, as in a step message) and is all its ``get`` needs; a forged or stale one is
refused as the four values it replaces are."""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np
import pytest

from _processes.handshake_children import ref_reader
from shmq import ObjectRef, ObjectStorage, RingBuffer


def test_a_reference_is_all_a_reader_process_needs(children) -> None:
    store = ObjectStorage(max_object_size=1 << 20, n_readers=1, ring_buffer=RingBuffer(4 << 20, create=True))
    out, refs = children.queue(), children.queue()
    children.start(ref_reader, out, store.handle(), refs)
    children.expect(out, "opened")
    pixels = np.arange(4096, dtype=np.float32)
    first = store.put_ref("image-1", {"pixels": pixels, "size": (64, 64)})
    assert isinstance(first, ObjectRef) and first.key == "image-1"
    assert len(pickle.dumps(first)) < 400  # a few dozen bytes and 32 ints, never the object
    refs.put(first)
    got = children.expect(out, "got")[1]
    assert got["size"] == (64, 64) and np.array_equal(got["pixels"], pixels)
    # The object sent again (a cache hit): ref() hands it out once more.
    refs.put(store.ref("image-1"))
    assert np.array_equal(children.expect(out, "got")[1]["pixels"], pixels)
    # A reference whose signature is not the writer's is refused, before anything is read.
    forged = replace(first, signature=tuple(0 for _ in first.signature))
    refs.put(forged)
    kind, message = children.expect(out, "refused")[1:]
    assert kind == "ValueError" and "signature" in message, message
    refs.put(None)
    children.join()
    with pytest.raises(KeyError):
        store.ref("never-put")
    with pytest.raises(TypeError, match="takes the reference alone"):
        store.get(first, 5)
    store.close()
