"""A reader process for the store's zero-copy ``get`` tests (``test_store_views.py``).

It keeps what it gets, by tag, and answers questions about it: whether a tensor's
memory lies in a mapping of the store's segment (a view) or elsewhere (a copy), what it
holds, after writing into it or not. Commands come on a queue, answers go back on
another (see ``_processes.Children``); every wait has a timeout.
"""

from __future__ import annotations

import gc
import os
import pickle
from typing import Any

import torch

from _processes import STEP
from _processes.store_children import signed_get
from shmq import ObjectStorage


def mapping_of(address: int) -> str:
    """The path of the mapping ``address`` lies in ("" for anonymous memory)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) == 6 else ""
    return "?"


def _payload(obj: Any) -> Any:
    """The tensor or array in a test object (itself, or under "t")."""
    return obj["t"] if isinstance(obj, dict) else obj


def _summary(t: Any) -> tuple:
    if isinstance(t, torch.Tensor):
        return ("tensor", str(t.dtype), tuple(t.shape), float(t.double().sum()), float(t.reshape(-1)[0]))
    return ("array", t.dtype.str, t.shape, float(t.astype("float64").sum()), float(t.reshape(-1)[0]))


def view_reader(out: Any, handle_pickle: bytes, cmds: Any) -> None:
    """Commands: ``("get", tag, address, id, copy)`` → ``("got", tag, summary, mapping)``
    (the mapping its data lies in) or ``("raised", tag, type, message)``;
    ``("check", tag)`` → ``("check", tag, summary)``; ``("write", tag, value)`` fills
    the kept object; ``("drop", tag)`` → ``("dropped", tag)``; ``("stop",)``."""
    store = ObjectStorage.create_from_handle(pickle.loads(handle_pickle))
    out.put(("ready", os.getpid(), store.ring_buffer.shared_memory.name))
    kept: dict[str, Any] = {}
    while True:
        cmd = cmds.get(timeout=STEP)
        op = cmd[0]
        if op == "stop":
            break
        tag = cmd[1]
        try:
            if op == "get":
                address, mid, copy = cmd[2:]
                if copy:
                    signature = list(store._make_signature("test-key", address, mid))
                    obj = store.get(address, mid, signature, "test-key", copy=True)
                else:
                    obj = signed_get(store, address, mid)
                kept[tag] = obj
                t = _payload(obj)
                ptr = t.data_ptr() if isinstance(t, torch.Tensor) else t.ctypes.data
                out.put(("got", tag, _summary(t), mapping_of(ptr)))
                del obj, t  # only `kept` holds it
            elif op == "check":
                out.put(("check", tag, _summary(_payload(kept[tag]))))
            elif op == "write":
                _payload(kept[tag])[...] = cmd[2]
                out.put(("written", tag))
            elif op == "drop":
                del kept[tag]
                gc.collect()
                out.put(("dropped", tag))
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except Exception as e:  # reported, not fatal: the test decides
            out.put(("raised", tag, type(e).__name__, str(e)))
    kept.clear()
    del store
    gc.collect()
    out.put(("stopped", os.getpid()))


def _locks_on(path: str) -> int:
    """How many locks the kernel lists (``/proc/locks``) on the file at ``path``."""
    st = os.stat(path)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with open("/proc/locks") as locks:
        return sum(1 for line in locks if line.split()[5] == inode)


def many_views_reader(out: Any, handle_pickle: bytes, handles: list[tuple[int, int]]) -> None:
    """Get every object of ``handles`` and keep the views; report how many locks the
    kernel keeps on the store's file then, and once they are all dropped."""
    store = ObjectStorage.create_from_handle(pickle.loads(handle_pickle))
    path = "/dev/shm/" + store.ring_buffer.shared_memory.name
    before = _locks_on(path)
    kept = [signed_get(store, address, mid) for address, mid in handles]
    in_mapping = sum(mapping_of(t.data_ptr()) == path for t in kept)
    holding = _locks_on(path)
    kept.clear()
    gc.collect()
    out.put(("locks", in_mapping, before, holding, _locks_on(path)))
