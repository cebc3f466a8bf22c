"""One copy per node, measured: a writer on host A, N readers on host B, over a veth link
shaped with ``tc`` (token bucket, ``--rate``), hosts made with network namespaces as in
tests/python/test_two_hosts.py. Needs root, iproute2 and tc.

For each way of reaching the N readers and each payload it reports the bytes the writer's
host sends per message (the veth's tx counter, all traffic: frames, headers, ACKs of
TCP) and the step latency: from the writer's ``enqueue`` to the last of the N readers
holding the message (p50 and p90 over the paced messages; the clock is shared, the
namespaces being on one machine):

- ``relay``: shmq, one remote reader (``python -m shmq relay`` on host B) and the N
  readers local readers of the relay's queue;
- ``streams``: shmq, the N readers each a remote reader (a stream each);
- ``vllm``: vLLM 0.33's ``MessageQueue``, the N readers each a remote reader.

    sudo .venv/bin/python scripts/relay_bench.py --readers 1,4,8 --rate 1gbit

Each role runs as ``relay_bench.py role ...`` in its namespace. Messages are sent paced
(``--interval-ms``) so that each is a step of its own, not a throughput run.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

NS_A, NS_B = "shmqbench_a", "shmqbench_b"
VETH_A, VETH_B = "shmqbv_a", "shmqbv_b"
IP_A, IP_B = "10.213.9.1", "10.213.9.2"
TIMEOUT = 120.0
WARMUP = 3


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def teardown() -> None:
    for ns in (NS_A, NS_B):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def setup(rate: str) -> None:
    teardown()
    _run("ip", "netns", "add", NS_A)
    _run("ip", "netns", "add", NS_B)
    _run("ip", "link", "add", VETH_A, "type", "veth", "peer", "name", VETH_B)
    _run("ip", "link", "set", VETH_A, "netns", NS_A)
    _run("ip", "link", "set", VETH_B, "netns", NS_B)
    for ns, dev, addr in ((NS_A, VETH_A, IP_A), (NS_B, VETH_B, IP_B)):
        _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        _run("ip", "-n", ns, "link", "set", dev, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        # Both directions: a token bucket at `rate` (bursts of 64 KiB; packets queue for
        # up to 200 ms). netem (for a delay) is not in every kernel; tbf is.
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
             "rate", rate, "burst", "64kb", "latency", "200ms")  # fmt: skip


def payload(kind: str, i: int) -> Any:
    if kind == "step":
        from shmq_bench.common import STEP_OBJECT

        return (i, STEP_OBJECT)
    import numpy as np

    n = {"1MiB": 1 << 20, "4MiB": 4 << 20}[kind]
    return (i, np.full(n // 4, i, dtype=np.float32))


def tx_bytes(dev: str) -> int:
    with open(f"/sys/class/net/{dev}/statistics/tx_bytes") as f:
        return int(f.read())


def _publish(workdir: str, name: str, data: bytes) -> None:
    path = os.path.join(workdir, name)
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.rename(path + ".tmp", path)


def _wait(workdir: str, name: str) -> bytes:
    path = os.path.join(workdir, name)
    deadline = time.monotonic() + TIMEOUT
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.02)
    with open(path, "rb") as f:
        return f.read()


def role_writer(impl: str, n: int, kind: str, messages: int, interval: float, workdir: str) -> None:
    if impl == "vllm":
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue as VQ

        mq: Any = VQ(n, 0, max_chunk_bytes=16 << 20, max_chunks=10, connect_ip=IP_A)
        _publish(workdir, "handle", pickle.dumps(mq.export_handle()))
    else:
        from shmq import MessageQueue

        n_remote = 1 if impl == "relay" else n
        mq = MessageQueue(n_remote, 0, max_chunk_bytes=16 << 20, max_chunks=10, connect_ip=IP_A)
        _publish(workdir, "handle", str(mq.export_handle()).encode())
    mq.wait_until_ready()
    for i in range(WARMUP):
        mq.enqueue(payload(kind, -1 - i))
    time.sleep(1.0)
    before = tx_bytes(VETH_A)
    sent = []
    start = time.monotonic()
    for i in range(messages):
        due = start + i * interval
        time.sleep(max(0.0, due - time.monotonic()))
        obj = payload(kind, i)
        sent.append(time.monotonic())
        mq.enqueue(obj)
    _wait(workdir, "all_read")
    after = tx_bytes(VETH_A)
    mq.enqueue(None)
    _publish(workdir, "writer.json", json.dumps({"sent": sent, "tx": after - before}).encode())
    time.sleep(1.0)
    if impl != "vllm":
        mq.shutdown()


def role_reader(impl: str, rank: int, handle_name: str, messages: int, workdir: str) -> None:
    raw = _wait(workdir, handle_name)
    if impl == "vllm":
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue as VQ

        mq: Any = VQ.create_from_handle(pickle.loads(raw), rank)
    else:
        from shmq import Handle, MessageQueue

        mq = MessageQueue.create_from_handle(Handle.from_str(raw.decode()), rank)
    mq.wait_until_ready()
    got = {}
    while True:
        m = mq.dequeue()
        if m is None:
            break
        if hasattr(m[1], "sum"):
            m[1].sum()  # read in full, as a worker would (a view of shared memory, else a copy)
        got[m[0]] = time.monotonic()
        if len([k for k in got if k >= 0]) == messages:
            _publish(workdir, f"read.{rank}", b"1")
    _publish(workdir, f"reader.{rank}.json", json.dumps({str(k): v for k, v in got.items()}).encode())


def _ns(ns: str, *args: str) -> subprocess.Popen:
    cmd = ["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__), *args]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def measure(impl: str, n: int, kind: str, messages: int, interval: float) -> dict:
    workdir = tempfile.mkdtemp(prefix="shmq-relay-bench-")
    procs = []
    try:
        common = [str(messages), workdir]
        procs.append(_ns(NS_A, "writer", impl, str(n), kind, str(messages), str(interval), workdir))
        if impl == "relay":
            _wait(workdir, "handle")
            relay = [
                "ip", "netns", "exec", NS_B, sys.executable, "-m", "shmq", "relay", "--handle-file",
                os.path.join(workdir, "handle"), "--rank", "0", "--local-readers", str(n),
                "--out", os.path.join(workdir, "relay.handle"),
            ]  # fmt: skip
            procs.append(subprocess.Popen(relay, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
            handle_name = "relay.handle"
        else:
            handle_name = "handle"
        for r in range(n):
            procs.append(_ns(NS_B, "reader", impl, str(r), handle_name, *common))
        deadline = time.monotonic() + TIMEOUT
        while not all(os.path.exists(os.path.join(workdir, f"read.{r}")) for r in range(n)):
            for p in procs:
                if p.poll() not in (None, 0):
                    raise RuntimeError(f"{impl} n={n}: a process failed:\n{p.communicate()[1][-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{impl} n={n}")
            time.sleep(0.05)
        _publish(workdir, "all_read", b"1")
        for p in procs:
            p.wait(TIMEOUT)
        w = json.loads(_wait(workdir, "writer.json"))
        readers = [json.loads(_wait(workdir, f"reader.{r}.json")) for r in range(n)]
        lat = sorted(max(rd[str(i)] for rd in readers) - w["sent"][i] for i in range(messages))
        return {
            "impl": impl,
            "readers": n,
            "payload": kind,
            "bytes_per_msg": w["tx"] / messages,
            "p50_ms": statistics.median(lat) * 1e3,
            "p90_ms": lat[int(0.9 * (len(lat) - 1))] * 1e3,
        }
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--readers", default="1,4,8")
    ap.add_argument("--impls", default="relay,streams,vllm")
    ap.add_argument("--payloads", default="step,1MiB")
    ap.add_argument("--rate", default="1gbit", help="the link's rate, each way (tc tbf)")
    ap.add_argument("--messages", type=int, default=30)
    ap.add_argument("--interval-ms", type=float, default=0, help="default: 20 ms (step), 200 ms (MiB payloads)")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (network namespaces, tc)", file=sys.stderr)
        return 2
    setup(args.rate)
    rows = []
    try:
        for kind in args.payloads.split(","):
            interval = (args.interval_ms or (20 if kind == "step" else 200)) / 1e3
            for n in [int(x) for x in args.readers.split(",")]:
                for impl in args.impls.split(","):
                    row = measure(impl, n, kind, args.messages, interval)
                    rows.append(row)
                    print(
                        f"{kind:>5} {impl:>8} readers={n}: {row['bytes_per_msg'] / 1024:10.1f} KiB/msg sent, "
                        f"step latency p50 {row['p50_ms']:8.2f} ms, p90 {row['p90_ms']:8.2f} ms",
                        flush=True,
                    )
    finally:
        teardown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "writer":
        _, _, impl, n, kind, messages, interval, workdir = sys.argv
        role_writer(impl, int(n), kind, int(messages), float(interval), workdir)
    elif len(sys.argv) > 1 and sys.argv[1] == "reader":
        _, _, impl, rank, handle_name, messages, workdir = sys.argv
        role_reader(impl, int(rank), handle_name, int(messages), workdir)
    else:
        sys.exit(main())
