"""A queue's name (``MessageQueue(name=...)``) where people look for it, from other
processes: ``python -m shmq inspect`` (the listing and one segment), ``top``, the
metrics' ``queue`` label, a local reader's ``mq.name``; bad names are refused."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest

from _processes import shmq_cli
from shmq import MessageQueue, metrics

NAME = "scheduler → workers"


def _reader_name(out: Any, handle: Any) -> None:
    mq = MessageQueue.create_from_handle(handle, 0)
    out.put((mq.name, repr(mq).startswith(f"<MessageQueue {NAME!r} local reader")))


def _shmq(*args: str) -> str:
    done = shmq_cli(*args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_named_queue_is_shown_by_name_in_other_processes() -> None:
    mq = MessageQueue(1, 1, name=NAME)
    unnamed = MessageQueue(1, 1)
    try:
        assert mq.name == NAME and unnamed.name is None
        assert mq.handle is not None and mq.handle.buffer_handle is not None
        ring = mq.handle.buffer_handle[3]
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        child = ctx.Process(target=_reader_name, args=(out, mq.export_handle()))
        child.start()
        assert out.get(timeout=60) == (NAME, True)
        child.join(timeout=60)
        listing = [line for line in _shmq("inspect").splitlines() if line.startswith(ring)]
        assert listing and f'broadcast ring of queue "{NAME}"' in listing[0]
        assert _shmq("inspect", ring).startswith(f'{ring}: broadcast ring of queue "{NAME}", 1 readers')
        assert f"{ring:<34} queue '{NAME}'" in _shmq("top", "--count", "1")
        found = {m["name"]: m for m in metrics.collect()}
        assert found[ring]["label"] == NAME
        assert unnamed.handle is not None and unnamed.handle.buffer_handle is not None
        assert found[unnamed.handle.buffer_handle[3]]["label"] is None
    finally:
        mq.shutdown()
        unnamed.shutdown()


def test_the_prometheus_collector_labels_a_queue_by_name() -> None:
    mq = MessageQueue(1, 1, name=NAME)
    try:
        assert mq.handle is not None and mq.handle.buffer_handle is not None
        ring = mq.handle.buffer_handle[3]
        labels = [
            s.labels
            for family in metrics.ShmqCollector().collect()
            for s in family.samples
            if s.labels.get("segment") == ring
        ]
        assert labels and all(label["queue"] == NAME for label in labels)
        assert any(label.get("reader") == "0" for label in labels)
    finally:
        mq.shutdown()


@pytest.mark.parametrize("bad", ["", "x" * 64, "line\nbreak"])
def test_a_bad_name_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="a queue's name must be 1 to 63 bytes of text with no control characters"):
        MessageQueue(1, 1, name=bad)


def test_a_name_that_is_not_text_is_refused() -> None:
    with pytest.raises(TypeError, match="name must be a str, got int"):
        MessageQueue(1, 1, name=7)  # type: ignore[arg-type]
