"""The ready handshake cannot deadlock (issue 59 item 1): a scheduler broadcasting steps to
three workers and gathering their results, in real processes, with every order of the
``wait_until_ready`` calls on each side. The order of ``examples/serving.py``'s workers
(steps, then results) against a scheduler that makes its ``Gather`` ready first (as the
README's Gather section does) used to block both sides until ``TimeoutError``: each side's
reader waited for a writer that was itself waiting, as a reader, for the other side.
A reader's readiness no longer waits on its writer's, so every order completes, over TCP
too."""

from __future__ import annotations

import itertools
import os
import uuid

import pytest

from _processes.handshake_children import reader_until_told, step_worker
from _processes.harness import STEP
from shmq import Gather, MessageQueue

WORKERS = 3
STEPS = 20


@pytest.mark.parametrize("transport", ["local", "remote"])
@pytest.mark.parametrize("scheduler", ["reader-first", "writer-first"])
@pytest.mark.parametrize("workers", ["reader-first", "writer-first"])
def test_any_order_of_wait_until_ready_completes(children, scheduler, workers, transport) -> None:
    # "remote": every reader of both directions over TCP (a remote reader waits only for
    # its connection; the writer's start is its first receive's), the workers' results
    # queues opened by name.
    remote = transport == "remote"
    out = children.queue()
    suffix = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    names = {f"worker-{r}": f"results-{suffix}-{r}" for r in range(WORKERS)}
    if remote:
        steps = MessageQueue(WORKERS, 0, connect_ip="127.0.0.1")
    else:
        steps = MessageQueue(WORKERS, WORKERS, max_chunk_bytes=4096, max_chunks=4)
    handle = steps.export_handle()
    for r in range(WORKERS):
        children.start(step_worker, out, handle, r, names[f"worker-{r}"], workers, STEPS, remote)
    assert sorted(children.expect(out, "made")[1] for _ in range(WORKERS)) == list(range(WORKERS))
    results = {w: MessageQueue.open(q, 0) for w, q in names.items()}
    # A Gather reads local readers; over TCP the results are read in turn.
    gather = None if remote else Gather(results)

    def make_results_ready() -> None:
        if gather is not None:
            gather.wait_until_ready(timeout=STEP)
        else:
            for reader in results.values():
                reader.wait_until_ready(timeout=STEP)

    def receive() -> tuple[str, tuple[int, int]]:
        if gather is not None:
            return gather.recv(timeout=STEP)
        w = next(receive.order)
        return w, results[w].dequeue(timeout=STEP)

    receive.order = itertools.cycle(names)  # type: ignore[attr-defined]
    # Each call within STEP: a deadlock is a TimeoutError here (or in a worker).
    if scheduler == "reader-first":
        make_results_ready()
        steps.wait_until_ready(timeout=STEP)
    else:
        steps.wait_until_ready(timeout=STEP)
        make_results_ready()
    assert sorted(children.expect(out, "ready")[1] for _ in range(WORKERS)) == list(range(WORKERS))
    got: dict[str, list] = {w: [] for w in names}
    for i in range(STEPS):
        steps.enqueue(i, timeout=STEP)
        for _ in range(WORKERS):
            w, (rank, value) = receive()
            assert w == f"worker-{rank}"
            got[w].append(value)
    assert got == {w: [i * i for i in range(STEPS)] for w in names}, "every result, in order"
    steps.shutdown()


def test_a_writer_that_times_out_names_the_queue_and_the_readers_not_made_yet(children) -> None:
    # Rank 0's reader is made (in another process) and ready at once; rank 1's never
    # is. The writer's timeout names its queue by the user's name, counts the
    # subscriptions, and says which ranks made their reader and which did not.
    name = f"steps-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    mq = MessageQueue(2, 2, max_chunk_bytes=1024, max_chunks=2, name=name)
    out, end = children.queue(), children.event()
    children.start(reader_until_told, out, mq.export_handle(), 0, end)
    pid = children.expect(out, "made")[1]
    with pytest.raises(TimeoutError) as info:
        mq.wait_until_ready(timeout=3.0)
    text = str(info.value)
    assert f"queue '{name}'" in text, text
    assert "1 of 2 local readers subscribed" in text, text
    assert f"readers made: rank 0 (pid {pid}); not made yet: rank 1" in text, text
    end.set()
    mq.shutdown()
