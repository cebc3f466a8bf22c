"""Telling the operator why a queue waits: warnings that name who is behind, live
metrics read from any process (``shmq.metrics``, ``python -m shmq inspect --json``,
``top``), and the Prometheus collector (also inside vLLM's registry)."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from _processes import (
    shmq_cli,
    STEP,
    busy_reader,
    counting_reader,
    named_store_and_cache,
    queue_side,
    stalling_writer,
    store_getter,
    wait_for,
    warning_reader,
)
from shmq import MessageQueue, ObjectStorage, RingBuffer, metrics

REPO_PYTHON = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "python")


def _warning(children, out, pattern: str, timeout: float = 15.0) -> str:
    """The first ``("warning", message)`` report matching ``pattern`` within ``timeout``."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        msg = children.receive(out, max(0.1, deadline - time.monotonic()))
        if msg[0] == "warning":
            seen.append(msg[1])
            if re.search(pattern, msg[1]):
                return msg[1]
    raise AssertionError(f"no warning matching {pattern!r} in {timeout} s; got:\n" + "\n".join(seen[-5:]))


def test_the_writers_warning_names_a_stopped_reader_then_its_death(children):
    out, cmds = children.queue(), children.queue()
    writer = children.start(stalling_writer, out, cmds, {"SHMQ_RINGBUFFER_WARNING_INTERVAL": "1"})
    handle = children.expect(out, "handle")[1]
    for rank in (0, 1):
        children.start(busy_reader, out, handle, rank)
    pids = {}
    while not ({0, 1, "ready"} <= pids.keys()):
        msg = children.receive(out, STEP)
        if msg[0] == "reader":
            pids[msg[1]] = msg[2]
        elif msg[0] == "ready":
            pids["ready"] = True
    # The stream is under way: the writer and both readers have handled messages.
    ring = handle.buffer_handle[3]
    wait_for(
        lambda: all(queue_side(ring, side)["messages"] > 0 for side in (None, 0, 1)),
        STEP,
        "the writer and both readers to handle messages",
    )
    # The busy queue, read by a third process while the writer streams.
    r = shmq_cli("inspect", "--json", handle.buffer_handle[3])
    assert r.returncode == 0, r.stderr
    busy = json.loads(r.stdout)
    assert busy["writer"]["messages"] > 0 and busy["writer"]["state"] == "alive", busy["writer"]
    assert [rd["pid"] for rd in busy["readers"]] == [pids[0], pids[1]], busy["readers"]
    assert all(rd["state"] == "alive" and rd["messages"] > 0 for rd in busy["readers"]), busy["readers"]
    os.kill(pids[1], signal.SIGSTOP)
    try:
        line = _warning(children, out, rf"reader 1 \(rank 1\): pid {pids[1]}, ")
        assert "alive but stopped (SIGSTOP" in line, line
        assert "not in the queue (busy elsewhere)" in line, line
        assert re.search(r"\d+ messages behind, last read \d+\.\d s ago", line), line
        assert "reader 0" not in line, f"reader 0 keeps up and is not behind: {line}"
        assert "waiting for readers to free a chunk for" in line, line
    finally:
        os.kill(pids[1], signal.SIGKILL)
    # The dead-reader policy acts (drop) and says whom it dropped.
    died = _warning(children, out, rf"reader 1 \(pid {pids[1]}\) of queue 'shmq_ring_[^']+' died")
    assert "going on without it" in died, died
    cmds.put("stop")
    while True:
        msg = children.receive(out, STEP)
        if msg[0] == "metrics":
            m = msg[1]
            break
    assert m["readers"][1]["dropped"] and m["readers"][1]["state"] == "dead", m["readers"][1]
    assert m["readers"][0]["state"] == "alive" and not m["readers"][0]["dropped"]
    assert m["writer"]["waits"] >= 1 and m["writer"]["wait_seconds"] > 0.5, m["writer"]
    writer.join(STEP)
    assert writer.exitcode == 0


def test_a_waiting_reader_names_the_writer_and_what_it_does(children):
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    out = children.queue()
    children.start(warning_reader, out, mq.export_handle(), 0, {"SHMQ_RINGBUFFER_WARNING_INTERVAL": "0.2"})
    mq.wait_until_ready(timeout=STEP)
    records = children.expect(out, "log")[1]["plain"]["records"]
    warnings = [r[2] for r in records if r[0].startswith("shmq") and r[1] >= 30]
    assert warnings, records
    for w in warnings:
        assert f"the writer: pid {os.getpid()}, alive, 0 messages written" in w, w
        assert "has not written a message yet, not in the queue (busy elsewhere)" in w, w


def test_counters_match_what_was_sent_and_received_read_from_a_third_process(children):
    n_small, n_arrays = 40, 4
    mq = MessageQueue(2, 2, max_chunk_bytes=1 << 16, max_chunks=4)
    ring = mq.export_handle().buffer_handle[3]
    out = children.queue()
    for rank in (0, 1):
        children.start(counting_reader, out, mq.export_handle(), rank)
    mq.wait_until_ready(timeout=STEP)
    for i in range(n_small):
        mq.enqueue({"step": i, "tokens": list(range(i % 7))}, timeout=STEP)
    for i in range(n_arrays):
        mq.enqueue(np.full(1 << 19, i, dtype=np.float32), timeout=STEP)  # 2 MiB: the arena
    loan = mq.loan_array((1 << 19,), "float32")
    loan[:] = 7
    mq.enqueue(loan, timeout=STEP)
    mq.enqueue(b"x" * (1 << 17), timeout=STEP)  # larger than a chunk: its body in the arena too
    mq.enqueue(None, timeout=STEP)
    sent = n_small + n_arrays + 3
    done = sorted(children.expect(out, "done")[1:] for _ in range(2))
    assert [d[1] for d in done] == [sent, sent]
    assert [d[2] for d in done] == [5 * (2 << 20)] * 2

    r = shmq_cli("inspect", "--json", ring)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)
    assert m["kind"] == "queue" and m["name"] == ring and m["n_reader"] == 2
    assert m["writer"]["pid"] == os.getpid() and m["writer"]["state"] == "alive"
    assert m["writer"]["messages"] == sent
    assert (m["arena_parts"], m["loaned_parts"], m["overflow_sends"]) == (n_arrays + 1, 1, 0)
    assert m["fallback_parts"] == 0 and m["remote_sends"] == 0
    for rd in m["readers"]:
        assert rd["messages"] == sent and rd["behind"] == 0, rd
        assert rd["bytes"] == m["writer"]["bytes"] > 0, (rd, m["writer"])
        assert rd["state"] == "dead" and not rd["dropped"], rd  # they have exited
    # Every segment at once (the list form) has the ring and its arena.
    every = json.loads(shmq_cli("inspect", "--json").stdout)
    kinds = {s["name"]: s["kind"] for s in every}
    assert kinds[ring] == "queue"
    arena = mq.export_handle().arena_name
    assert kinds[arena] == "arena"
    assert next(s for s in every if s["name"] == ring)["creator_pid"] == os.getpid()

    # The same numbers through Prometheus.
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    registry = prometheus_client.CollectorRegistry()
    metrics.register_prometheus(registry)
    text = prometheus_client.generate_latest(registry).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("segment") == ring:
                samples[(s.name, s.labels.get("reader"))] = s.value
    assert samples[("shmq_queue_sent_messages_total", None)] == sent
    assert samples[("shmq_queue_arena_parts_total", None)] == n_arrays + 1
    assert samples[("shmq_queue_loaned_parts_total", None)] == 1
    assert samples[("shmq_queue_overflow_sends_total", None)] == 0
    for reader in ("0", "1"):
        assert samples[("shmq_queue_reader_messages_total", reader)] == sent
        assert samples[("shmq_queue_reader_lag_messages", reader)] == 0
        assert samples[("shmq_queue_reader_up", reader)] == 0  # exited
    assert ("shmq_queue_writer_wait_seconds_total", None) in samples
    assert ("shmq_queue_reader_wait_seconds_total", "0") in samples


def test_store_counters_across_processes(children):
    ring = RingBuffer(1 << 20, create=True)
    store = ObjectStorage(1 << 16, 1, ring)
    keys = [f"k{i}" for i in range(3)]
    handles = []
    for k in keys:
        address, mid = store.put(k, {"key": k})
        handles.append((address, mid, list(store._make_signature(k, address, mid)), k))
    out = children.queue()
    children.start(store_getter, out, pickle.dumps(store.handle()), handles)
    assert children.expect(out, "got")[1] == [{"key": k} for k in keys]
    r = shmq_cli("inspect", "--json", ring.handle()[1])
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["kind"] == "store" and s["creator_pid"] == os.getpid(), s
    assert (s["puts"], s["gets"], s["objects"]) == (3, 3, 3), s
    assert s["evictions"] == 0 and s["bytes_in_use"] > 0 and s["capacity"] == 1 << 20, s


def test_store_and_cache_metrics_carry_the_names_they_were_made_with(children):
    """A store's samples carry a ``store`` label (the name it was made with) and an
    encoder cache's a ``cache`` label (the name consumers open it by), read here from
    segments another process made."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    store_name = f"mm-store-{os.getpid()}"
    cache_name = f"encoder-{os.getpid()}"
    out, end = children.queue(), children.event()
    children.start(named_store_and_cache, out, store_name, cache_name, end)
    _, store_segment, cache_segment = children.expect(out, "made")
    registry = prometheus_client.CollectorRegistry()
    metrics.register_prometheus(registry)
    text = prometheus_client.generate_latest(registry).decode()
    end.set()
    labels = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("segment") in (store_segment, cache_segment):
                labels[s.name] = s.labels
    assert labels["shmq_store_puts_total"] == {"segment": store_segment, "store": store_name}, labels
    assert labels["shmq_store_objects"]["store"] == store_name, labels
    assert labels["shmq_encoder_cache_saves_total"] == {"segment": cache_segment, "cache": cache_name}, labels
    assert labels["shmq_encoder_cache_entries"]["cache"] == cache_name, labels


def test_top_shows_a_live_queue_with_its_readers(children):
    mq = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2)
    out = children.queue()
    children.start(counting_reader, out, mq.export_handle(), 0)
    mq.wait_until_ready(timeout=STEP)
    for i in range(10):
        mq.enqueue(i, timeout=STEP)
    r = shmq_cli("top", "--count", "2", "--interval", "0.2")
    mq.enqueue(None, timeout=STEP)
    children.expect(out, "done")
    assert r.returncode == 0, r.stderr
    ring = mq.export_handle().buffer_handle[3]
    assert r.stdout.count("shmq top") == 2, r.stdout
    line = next(x for x in r.stdout.splitlines() if x.startswith(ring))
    assert f"writer pid {os.getpid()} (alive) 10 msgs" in line, line
    assert re.search(r"reader 0: pid \d+ \(alive\) 10 msgs .*0 behind, waiting in the queue", r.stdout), r.stdout


def test_inspect_json_of_a_missing_segment_is_a_clear_error():
    r = shmq_cli("inspect", "--json", "shmq_ring_1_deadbeef")
    assert r.returncode == 1 and "error:" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_vllm_plugin_puts_shmq_metrics_in_vllms_registries(tmp_path):
    pytest.importorskip("prometheus_client")
    try:
        import vllm  # noqa: F401
    except ImportError:
        if os.environ.get("SHMQ_REQUIRE_VLLM") == "1":
            raise
        pytest.skip("vLLM is not installed (see tests/python/vllm-requirements.txt)")
    script = """
import json, os
import shmq.vllm_plugin
shmq.vllm_plugin.register()
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
q = MessageQueue(1, 1)
assert type(q).__module__.startswith("shmq"), type(q)
from prometheus_client import REGISTRY
from vllm.v1.metrics.prometheus import get_prometheus_registry
names = lambda reg: sorted({f.name for f in reg.collect() if f.name.startswith("shmq_")})
print(json.dumps({"global": names(REGISTRY), "served": names(get_prometheus_registry()),
                  "ring": q.export_handle().buffer_handle[3],
                  "labels": sorted({s.labels.get("segment", "") for f in get_prometheus_registry().collect()
                                    for s in f.samples if f.name == "shmq_queue_sent_messages"})}))
"""
    env = dict(os.environ, SHMQ_VLLM="1", PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for where in ("global", "served"):
        assert "shmq_queue_sent_messages" in got[where], got
        assert "shmq_queue_reader_lag_messages" in got[where], got
    assert got["ring"] in got["labels"], got
    assert "shmq's metrics are in vLLM's /metrics" in r.stderr, r.stderr[-2000:]


def test_a_full_store_says_which_object_holds_the_room():
    store = ObjectStorage(1024, 1, RingBuffer(8192, create=True))
    with pytest.raises(MemoryError) as e:
        for i in range(100):
            store.put(f"k{i}", b"x" * 900)
    message = str(e.value)
    assert message.startswith("Not enough space in the data buffer"), message  # vLLM's words first
    assert 'what holds the room: the oldest of the' in message, message
    assert 'key "k0", read 0 times of the 1 it waits for' in message, message


def test_inspect_into_a_reader_that_stopped_reading_exits_quietly():
    """``python -m shmq inspect --json | head -1``: when whoever reads the output has
    gone, the command stops with status 141 (a shell's SIGPIPE status) and prints
    nothing, no ``BrokenPipeError`` traceback. A pipe whose read end is closed before the
    command starts makes its first write fail, every time."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run(
            [sys.executable, "-m", "shmq", "inspect", "--json"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=STEP,
            check=False,
        )
    finally:
        os.close(write_end)
    assert r.stderr == ""
    assert r.returncode == 141
    # The pipeline itself, with output to cut (a queue exists): head's line, no traceback.
    mq = MessageQueue(1, 1, max_chunk_bytes=1 << 12, max_chunks=2)
    r = subprocess.run(
        ["sh", "-c", f"'{sys.executable}' -m shmq inspect --json | head -1"],
        capture_output=True,
        text=True,
        timeout=STEP,
        check=False,
    )
    assert r.returncode == 0 and r.stdout == "[\n" and r.stderr == "", r
    del mq


def test_the_metrics_server_listens_on_localhost_unless_told_otherwise():
    """``metrics.start_http_server(port)`` binds 127.0.0.1 (prometheus_client's own
    default is every interface); ``addr=`` still chooses."""
    pytest.importorskip("prometheus_client")
    import urllib.request

    server, _ = metrics.start_http_server(0)
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=STEP) as page:
            assert page.status == 200
    finally:
        server.shutdown()
        server.server_close()
    server, _ = metrics.start_http_server(0, addr="0.0.0.0")
    try:
        assert server.server_address[0] == "0.0.0.0"
    finally:
        server.shutdown()
        server.server_close()
