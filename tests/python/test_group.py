"""StatelessProcessGroup and MessageQueue.create_from_process_group, in real processes.

Every group member is a spawned child (``_processes.group_queue_member`` and friends);
the test collects their reports, then releases them (``release``) so that no member —
in particular rank 0, which hosts the TCPStore — leaves while others still use the
group.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from _processes import (
    STEP,
    barrier_then_exit_member,
    free_port,
    group_queue_member,
    stateless_expiry_member,
    stateless_ops_member,
)

BIG = 64 * 1024  # max_chunk_bytes; about one object in eight is larger
WORLD = 4


def _run_group(children, kind, plan, writer_rank, *, subgroup=None, remote=False, max_chunks=4):
    """Start WORLD members of a ``kind`` group; return the writer's "sent" reports and
    the readers' "done" reports (both by queue index)."""
    out = children.queue()
    release = children.event()
    port = free_port()
    for rank in range(WORLD):
        children.start(
            group_queue_member,
            out,
            kind,
            port,
            rank,
            WORLD,
            subgroup,
            writer_rank,
            plan,
            BIG,
            max_chunks,
            remote,
            release,
        )
    members = WORLD if subgroup is None else len(subgroup)
    n_reports = len(plan) * members + (WORLD - members)
    sent: dict[int, dict] = {}
    done: dict[int, list[dict]] = {qi: [] for qi in range(len(plan))}
    outside = []
    for _ in range(n_reports):
        msg = children.receive(out, timeout=4 * STEP)
        if msg[0] == "sent":
            sent[msg[1]["queue"]] = msg[1]
        elif msg[0] == "done":
            done[msg[1]["queue"]].append(msg[1])
        else:
            assert msg[0] == "outside", msg
            outside.append(msg[1])
    release.set()
    children.join()
    return sent, done, outside


def _check_stream(done, n, group_ranks):
    assert sorted(r["group_rank"] for r in done) == sorted(group_ranks)
    for r in done:
        assert r["count"] == n, r
        assert r["n_mismatch"] == 0, r
        assert r["extra"] is None, r


@pytest.mark.parametrize("kind", ["gloo", "stateless"])
def test_queue_from_process_group_writer_rank_2(children, kind):
    writer = 2
    plan = [(1234, 2000), (99, 300)]  # the second queue on the same group
    sent, done, _ = _run_group(children, kind, plan, writer)
    readers = [r for r in range(WORLD) if r != writer]
    for qi, (_, n) in enumerate(plan):
        s = sent[qi]
        assert s["group_rank"] == writer
        # All on this machine: every other rank is a local reader, none is remote.
        assert s["local_reader_ranks"] == readers
        assert (s["n_local_reader"], s["n_remote_reader"]) == (WORLD - 1, 0)
        _check_stream(done[qi], n, readers)
        for r in done[qi]:
            assert r["local"] is True
            # Reader index = position in local_reader_ranks.
            assert r["local_reader_rank"] == readers.index(r["group_rank"])


@pytest.mark.parametrize("kind", ["gloo", "stateless"])
def test_queue_from_process_group_with_remote_readers(children, kind):
    """Same-machine detection replaced (``shmq.group.in_the_same_node_as``, in every
    member) so that every reader is remote: the handle travels through the group and
    the readers subscribe over TCP to 127.0.0.1 (``SHMQ_HOST_IP``)."""
    writer = 1
    plan = [(7, 500)]
    sent, done, _ = _run_group(children, kind, plan, writer, remote=True)
    s = sent[0]
    assert s["local_reader_ranks"] == []
    assert (s["n_local_reader"], s["n_remote_reader"]) == (0, WORLD - 1)
    assert s["remote_subscribe_addr"].startswith("tcp://127.0.0.1:")
    _check_stream(done[0], 500, [r for r in range(WORLD) if r != writer])
    assert all(r["local"] is False for r in done[0])


def test_queue_from_torch_subgroup(children):
    """A new_group of world ranks [1, 2, 3]: group ranks 0, 1, 2 are not the world
    ranks, and the writer (group rank 0) is world rank 1."""
    plan = [(4321, 400)]
    sent, done, outside = _run_group(children, "gloo", plan, 0, subgroup=[1, 2, 3])
    assert outside == [0]
    s = sent[0]
    assert (s["rank"], s["group_rank"]) == (1, 0)
    assert s["local_reader_ranks"] == [1, 2]  # group ranks, not world ranks
    _check_stream(done[0], 400, [1, 2])
    assert sorted((r["rank"], r["group_rank"], r["local_reader_rank"]) for r in done[0]) == [(2, 1, 0), (3, 2, 1)]


def test_stateless_group_operations(children):
    world = 3
    out = children.queue()
    release = children.event()
    port = free_port()
    for rank in range(world):
        children.start(stateless_ops_member, out, port, rank, world, release)
    seen = {}
    for _ in range(world):
        msg = children.expect(out, "seen", timeout=4 * STEP)
        seen[msg[1]["rank"]] = msg[1]
    release.set()
    children.join()
    assert sorted(seen) == list(range(world))
    for rank, s in seen.items():
        assert s["world_size"] == world
        assert s["received"] == {
            src: [(src, rank, i, list(range(i + src))) for i in range(3)] for src in range(world) if src != rank
        }
        assert s["broadcast"] == [{"from": src, "payload": "x" * src} for src in range(world)]
        assert s["all_gather"] == [("rank", r, [r] * r) for r in range(world)]
        assert s["barrier_s"] < STEP
    for rank in range(world - 1):
        kind, message, elapsed = seen[rank]["timeout"]
        assert kind == "RuntimeError", seen[rank]["timeout"]
        # Names the rank that stayed away, and only it.
        assert re.search(r"\[2\]", message), message
        assert "[0" not in message and "1]" not in message, message
        assert 0.9 < elapsed < STEP


def test_stateless_group_expire_data(children):
    out = children.queue()
    release = children.event()
    port = free_port()
    for rank in range(2):
        children.start(stateless_expiry_member, out, port, rank, 1.0, release)
    reports = {}
    for _ in range(2):
        _, rank, report = children.expect(out, "expiry", timeout=4 * STEP)
        reports[rank] = report
    release.set()
    children.join()
    r0, r1 = reports[0], reports[1]
    assert r0["data_expiration_seconds"] == 1.0
    assert r0["old_before"] is True
    assert r0["old_after_expire"] is False
    assert r0["new_after_expire"] is True
    assert "send_to/1/from/0/0" not in r0["entries"]
    assert "send_to/1/from/0/1" in r0["entries"]
    assert r1["got"] == ["old", "new"]


def test_import_shmq_does_not_import_torch():
    code = "import sys, shmq; from shmq import StatelessProcessGroup; print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=STEP)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_every_rank_may_exit_right_after_a_barrier(children):
    # Without the barrier's "left" phase, rank 0 (the store's host) could exit while the
    # others still polled the store, and they failed with a connection error.
    out = children.queue()
    port = free_port()
    for rank in range(WORLD):
        children.start(barrier_then_exit_member, out, port, rank, WORLD, 5)
    assert sorted(children.expect(out, "passed")[1] for _ in range(WORLD)) == list(range(WORLD))
    children.join()
