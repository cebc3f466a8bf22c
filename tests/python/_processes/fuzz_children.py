"""Children of ``test_fuzz.py``: a store writer whose segment the test reads as a reader
process would, with handles of every kind."""

from __future__ import annotations

from typing import Any

from .harness import STEP

#: What the store writer puts, by key.
STORE_VALUES: dict[str, Any] = {
    "small": {"req_ids": list(range(16)), "flag": True, "name": "scheduler-output"},
    "bytes": b"\x00\x01" * 300,
    "empty": [],
    "nested": {"images": [b"a" * 100, b"b" * 7], "shape": (3, 224, 224)},
}


def store_writer(out: Any, done: Any) -> None:
    """Make a store, put ``STORE_VALUES`` (plus a raw chunk through the ring's own API, and
    an object that is freed again, so that stale handles exist), report
    ``("ready", handle, [(key, address, id, signature)])`` and keep the segment until
    ``done`` is set."""
    import numpy as np

    from shmq import ObjectStorage, RingBuffer

    ring = RingBuffer(16384, create=True)
    store = ObjectStorage(8192, 1, ring)
    gone = store.put("gone", b"x" * 50)
    handles = []
    for key, value in {**STORE_VALUES, "array": np.arange(50, dtype=np.float32)}.items():
        address, monotonic_id = store.put(key, value)
        handles.append((key, address, monotonic_id, store.get_signature(key)))
    ring.allocate_buf(13)  # not an object
    # "gone" is freed only once read: the writer's own get counts when asked to; free it.
    store.ring_buffer.free_buf(lambda i, _: i == gone[1], None)
    handles.append(("gone", gone[0], gone[1], store._core._sign("gone", *gone)))
    out.put(("ready", store.handle(), handles))
    done.wait(STEP)
    store.close()
