"""A soak of MessageQueue: one writer and several reader processes, a long mixed stream,
one reader SIGKILLed partway, and /dev/shm and memory watched from start to end.

    python scripts/soak.py                          # 10^6 messages, 3 readers (4 processes)
    python scripts/soak.py --messages 20000 --json  # the short run the test suite makes

The writer (this process) sends ``--messages`` messages to ``--readers`` local readers
(spawned processes) through one ``MessageQueue(on_dead_reader="drop")``, a mix of

* small objects (a dict of a few fields),
* arena-sized arrays (int64, 1-4 MiB: they go through the tensor arena), half of them
  copied in from an ordinary array and half loaned (``loan_array``, filled in place),
* over-chunk messages (an int64 array of 96-768 KiB: below the arena's threshold, above
  ``max_chunk_bytes``, so the message goes over the queue's local ZeroMQ socket).

Every message carries its sequence number, and its payload says it again (the fields of
a small object; an array's first, middle and last elements), so each reader checks the
order and the content of everything it gets, cheaply. After ``--kill-after`` messages
the writer SIGKILLs one reader (``--kill-rank``) and goes on without it; the others must
get every message, in order, exactly once. They report over a ``multiprocessing`` pipe,
not over shmq.

After ``--warmup`` messages, and again at the end (every message read, before the queue
is shut down), the writer samples the soak's own shmq segments in ``/dev/shm`` (bytes
allocated to the ``shmq_*`` files its processes created; the whole file system's used
bytes are reported too, but other processes may share it, so it is judged only with
``--fs-growth-mib``) and each process's RSS (psutil, else ``VmRSS`` in
``/proc/<pid>/status``). A progress line (rate, /dev/shm, every process's RSS) goes to
stderr every ``--progress`` seconds.

The run fails (exit status 1, each reason on stderr) if

* a surviving reader lost, duplicated, reordered or garbled a message, or crashed, or
  the writer did not drop exactly the killed reader, or a wait took longer than 60 s
  (a hang: the writer's enqueue and the readers' dequeue have timeouts);
* the soak's segments in ``/dev/shm`` grew by more than ``--shm-growth-mib`` (default
  8 MiB) from the warm-up sample to the end: the arena (128 MiB) is reserved whole before the
  start (``reserve_arena``), so only a leak (a segment not removed, a ring that keeps
  committing) can grow them; the ring's own chunks are 16 x 64 KiB;
* any surviving process's RSS grew by more than ``--rss-growth-mib`` (default 64 MiB)
  from the warm-up sample to the end: a leak of 100 bytes per message shows at 10^6;
  the noise (allocator, arena pages first touched) is a few MiB;
* with ``--fs-growth-mib``, /dev/shm's used bytes as a whole grew by more than that;
* a ``shmq_*`` file made by one of the soak's processes is left in ``/dev/shm`` once the
  queue is shut down and every process has exited.

``--json`` prints a machine-readable summary on stdout (``"ok"``: the verdict,
``"failures"``: the reasons). The bounds do not scale with ``--messages``: a short run is
a smoke test; the run of 10^6 is the one that can see a slow leak.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import time
from typing import Any

MiB = 1 << 20
KiB = 1 << 10
SHM_DIR = "/dev/shm"
CHUNK_BYTES = 64 * KiB
CHUNKS = 16
ARENA_BYTES = 128 * MiB
ARENA_SIZES = (MiB, 2 * MiB, 3 * MiB, 4 * MiB)  # bytes of the arena-sized arrays
OVER_SIZES = (96 * KiB, 256 * KiB, 512 * KiB, 768 * KiB)  # bytes of the over-chunk arrays
WAIT = 60.0  # longest an enqueue or a dequeue may wait before it counts as a hang
ERRORS_KEPT = 10

try:
    import psutil
except ImportError:  # pragma: no cover - psutil is optional
    psutil = None

# What reading a process's RSS may raise.
_RSS_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError) + ((psutil.Error,) if psutil is not None else ())


# ---------------------------------------------------------------------------------
# Measurements


def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` (None once it is gone)."""
    try:
        if psutil is not None:
            return int(psutil.Process(pid).memory_info().rss)
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except _RSS_ERRORS:
        return None
    return None


def segment_pid(name: str) -> int | None:
    """The creator's pid in a segment's name (``shmq_<kind>_<pid>_<random>``)."""
    parts = name.split("_")
    if len(parts) >= 4 and parts[0] == "shmq" and parts[2].isdigit():
        return int(parts[2])
    return None


def own_segments(pids: set[int]) -> dict[str, int]:
    """The soak's ``shmq_*`` files in /dev/shm and the bytes allocated to each (what they
    take of /dev/shm; a segment's apparent size is sparse). A socket directory counts 0."""
    out: dict[str, int] = {}
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:  # pragma: no cover - no /dev/shm
        return out
    for name in names:
        if name.startswith("shmq_") and segment_pid(name.split(".")[0]) in pids:
            try:
                st = os.stat(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                continue
            out[name] = 0 if os.path.isdir(os.path.join(SHM_DIR, name)) else st.st_blocks * 512
    return out


def shm_fs_used() -> int:
    st = os.statvfs(SHM_DIR)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def sample(procs: dict[str, int]) -> dict[str, Any]:
    segs = own_segments(set(procs.values()))
    return {
        "t": time.monotonic(),
        "shm_own_bytes": sum(segs.values()),
        "shm_own_files": sorted(segs),
        "shm_fs_used_bytes": shm_fs_used(),
        "rss": {name: rss_bytes(pid) for name, pid in procs.items()},
    }


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


# ---------------------------------------------------------------------------------
# Messages: what the writer sends for seq, and what a reader checks


def check(msg: Any, seq: int) -> str | None:
    """None if ``msg`` is message ``seq`` intact, else what is wrong."""
    if not isinstance(msg, dict) or "seq" not in msg:
        return f"expected message {seq}, got {type(msg).__name__} {str(msg)[:80]!r}"
    got = msg["seq"]
    if got != seq:
        return f"expected message {seq}, got message {got} ({'reordered/duplicated' if got < seq else 'lost'})"
    kind = msg.get("kind")
    if kind == "small":
        if msg["name"] != f"request-{seq}" or msg["ids"] != [seq, seq + 1, seq + 2] or msg["sum"] != 3 * seq + 3:
            return f"message {seq} (small): garbled fields {str(msg)[:120]}"
    elif kind in ("arena", "loan", "over"):
        a = msg["a"]
        if a.dtype.str != "<i8" or a.nbytes != msg["nbytes"]:
            return f"message {seq} ({kind}): array of {a.dtype} x {a.size}, expected int64 of {msg['nbytes']} bytes"
        if int(a[0]) != seq or int(a[a.size // 2]) != seq or int(a[-1]) != seq:
            return f"message {seq} ({kind}): payload {int(a[0])}, {int(a[a.size // 2])}, {int(a[-1])} != {seq}"
    elif kind != "end":
        return f"message {seq}: unknown kind {kind!r}"
    return None


class Sender:
    """Makes message ``seq`` of the mix (the kinds are drawn from ``seed``)."""

    def __init__(self, mq: Any, seed: int, arena_fraction: float, over_fraction: float):
        import numpy as np

        self.mq = mq
        self.rng = random.Random(seed)
        self.arena_fraction, self.over_fraction = arena_fraction, over_fraction
        # Ordinary arrays to copy from, one per size: enqueue copies them (into the arena
        # or the message), so they can be rewritten for the next message at once.
        self.arena_arrays = [np.zeros(n // 8, dtype=np.int64) for n in ARENA_SIZES]
        self.over_arrays = [np.zeros(n // 8, dtype=np.int64) for n in OVER_SIZES]
        self.sent = {"small": 0, "arena": 0, "loan": 0, "over": 0}

    @staticmethod
    def _stamp(a: Any, seq: int) -> Any:
        a[0] = a[a.size // 2] = a[-1] = seq
        return a

    def message(self, seq: int) -> dict[str, Any]:
        x = self.rng.random()
        if x < self.arena_fraction:
            nbytes = self.rng.choice(ARENA_SIZES)
            if x < self.arena_fraction / 2:
                kind, a = "loan", self.mq.loan_array((nbytes // 8,), "int64")
            else:
                kind, a = "arena", self.arena_arrays[ARENA_SIZES.index(nbytes)]
            msg = {"seq": seq, "kind": kind, "nbytes": nbytes, "a": self._stamp(a, seq)}
        elif x < self.arena_fraction + self.over_fraction:
            nbytes = self.rng.choice(OVER_SIZES)
            a = self.over_arrays[OVER_SIZES.index(nbytes)]
            kind = "over"
            msg = {"seq": seq, "kind": kind, "nbytes": nbytes, "a": self._stamp(a, seq)}
        else:
            kind = "small"
            ids = [seq, seq + 1, seq + 2]
            msg = {"seq": seq, "kind": kind, "name": f"request-{seq}", "ids": ids, "sum": 3 * seq + 3}
        self.sent[kind] += 1
        return msg


# ---------------------------------------------------------------------------------
# Readers


def reader(handle: Any, rank: int, n: int, conn: Any) -> None:
    """Read messages 0..n-1 and the end marker n, checking each; report over ``conn``,
    then wait for the writer's "bye" (so that it can measure this process first)."""
    from shmq import MessageQueue

    report: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "received": 0, "errors": [], "n_errors": 0}
    kinds = {"small": 0, "arena": 0, "loan": 0, "over": 0}
    try:
        mq = MessageQueue.create_from_handle(handle, rank)
        mq.wait_until_ready(timeout=WAIT)
        conn.send(("ready", rank, os.getpid()))
        expected = 0
        while True:
            msg = mq.dequeue(timeout=WAIT)
            problem = check(msg, expected)
            if problem is not None:
                report["n_errors"] += 1
                if len(report["errors"]) < ERRORS_KEPT:
                    report["errors"].append(problem)
                got = msg.get("seq") if isinstance(msg, dict) else None
                # Go on from what came, so that one loss is not counted at every message.
                expected = got if isinstance(got, int) else expected
            if isinstance(msg, dict) and msg.get("kind") == "end":
                break
            if isinstance(msg, dict) and msg.get("kind") in kinds:
                kinds[msg["kind"]] += 1
            report["received"] += 1
            expected += 1
            del msg
        report["end_seq"] = expected
    except BaseException as e:  # a timeout (hang) or an error from the queue
        report["exception"] = f"{type(e).__name__}: {e}"
    report["kinds"] = kinds
    gc.collect()
    conn.send(("report", report))
    conn.recv()  # "bye"
    conn.close()


# ---------------------------------------------------------------------------------
# The writer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("The run fails") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--messages", type=int, default=1_000_000, help="messages to send (default 10^6)")
    p.add_argument("--readers", type=int, default=3, help="local reader processes (default 3: 4 processes in all)")
    p.add_argument(
        "--kill-after", type=int, default=None, help="SIGKILL a reader once this many are sent (default: a third)"
    )
    p.add_argument("--kill-rank", type=int, default=1, help="the reader killed (default 1)")
    p.add_argument(
        "--warmup", type=int, default=None, help="messages before the first sample (default: 5%%, at least 2000)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the mix (default 0)")
    p.add_argument("--arena-fraction", type=float, default=0.03, help="share of arena-sized arrays (default 0.03)")
    p.add_argument("--over-fraction", type=float, default=0.03, help="share of over-chunk messages (default 0.03)")
    p.add_argument(
        "--shm-growth-mib", type=float, default=8.0, help="bound on the growth of the soak's segments (default 8)"
    )
    p.add_argument(
        "--fs-growth-mib",
        type=float,
        default=None,
        help="also bound the growth of /dev/shm's used bytes as a whole (default: reported, not judged; "
        "set it where nothing else uses /dev/shm meanwhile)",
    )
    p.add_argument("--rss-growth-mib", type=float, default=64.0, help="bound on each process's RSS growth (default 64)")
    p.add_argument("--progress", type=float, default=10.0, help="seconds between progress lines on stderr (default 10)")
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    args = p.parse_args(argv)
    if args.messages < 1 or args.readers < 2:
        p.error("--messages must be >= 1 and --readers >= 2 (one is killed, the others must read everything)")
    if not 0 <= args.kill_rank < args.readers:
        p.error(f"--kill-rank must be in 0..{args.readers - 1}")
    if args.kill_after is None:
        args.kill_after = args.messages // 3
    # The writer drops a dead reader when it needs a chunk that reader has not read: it
    # must go round the ring (CHUNKS messages) at least once after the kill.
    if not 0 <= args.kill_after <= args.messages - 4 * CHUNKS:
        p.error(f"--kill-after must be in 0..messages - {4 * CHUNKS}, so that the writer meets the dead reader")
    if args.warmup is None:
        args.warmup = min(args.messages, max(2000, args.messages // 20))
    return args


def log(text: str) -> None:
    print(f"[soak] {text}", file=sys.stderr, flush=True)


def progress_line(elapsed: float, seq: int, n: int, rate_now: float | None, s: dict[str, Any]) -> str:
    rss = ", ".join(f"{name} {mib(v)}" for name, v in s["rss"].items())
    now = "" if rate_now is None else f"{rate_now:,.0f} msg/s now, "
    return (
        f"{elapsed:7.1f} s  {seq}/{n} sent  {now}{seq / max(elapsed, 1e-9):,.0f} avg  "
        f"/dev/shm: soak {mib(s['shm_own_bytes'])} MiB (fs used {mib(s['shm_fs_used_bytes'])} MiB)  RSS MiB: {rss}"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from shmq import MessageQueue

    failures: list[str] = []
    n, n_readers = args.messages, args.readers
    mq = MessageQueue(
        n_reader=n_readers,
        n_local_reader=n_readers,
        max_chunk_bytes=CHUNK_BYTES,
        max_chunks=CHUNKS,
        on_dead_reader="drop",
        arena_bytes=ARENA_BYTES,
    )
    # The whole arena in /dev/shm before the first sample: its use then cannot grow.
    mq.reserve_arena(ARENA_BYTES)
    ctx = mp.get_context("spawn")
    conns, readers = [], []
    for rank in range(n_readers):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=reader, args=(mq.export_handle(), rank, n, child), name=f"soak-reader-{rank}")
        p.start()
        child.close()
        conns.append(parent)
        readers.append(p)
    procs: dict[str, int] = {"writer": os.getpid(), **{f"r{r}": int(p.pid or 0) for r, p in enumerate(readers)}}
    all_pids = set(procs.values())
    mq.wait_until_ready(timeout=WAIT)
    for c in conns:
        if not c.poll(WAIT):
            raise RuntimeError("a reader did not start")
        c.recv()
    log(f"{n} messages, {n_readers} readers (pids {[p.pid for p in readers]}), writer pid {os.getpid()}, "
        f"reader {args.kill_rank} killed after {args.kill_after}, warm-up {args.warmup}, seed {args.seed}")

    sender = Sender(mq, args.seed, args.arena_fraction, args.over_fraction)
    victim = readers[args.kill_rank]
    killed = False
    warm: dict[str, Any] | None = None
    samples: list[dict[str, Any]] = []
    start = last_t = time.monotonic()
    last_seq = 0
    sent = 0
    try:
        for seq in range(n):
            if seq == args.warmup:
                gc.collect()
                warm = sample(procs)
                log(progress_line(time.monotonic() - start, seq, n, None, warm) + "  <- warm-up sample")
            if seq == args.kill_after and not killed:
                os.kill(victim.pid, signal.SIGKILL)
                killed = True
                log(f"reader {args.kill_rank} (pid {victim.pid}) SIGKILLed after {seq} messages")
                procs = {k: v for k, v in procs.items() if k != f"r{args.kill_rank}"}
            msg = sender.message(seq)
            mq.enqueue(msg, timeout=WAIT)
            del msg  # a loan goes back once every reader has dropped its view
            sent = seq + 1
            if not seq & 255:
                t = time.monotonic()
                if t - last_t >= args.progress:
                    s = sample(procs)
                    samples.append({"seq": seq, "t": t - start, "shm_own_bytes": s["shm_own_bytes"], "rss": s["rss"]})
                    log(progress_line(t - start, seq, n, (seq - last_seq) / (t - last_t), s))
                    last_t, last_seq = t, seq
        mq.enqueue({"seq": n, "kind": "end"}, timeout=WAIT)
    except TimeoutError as e:
        failures.append(f"the writer waited more than {WAIT:.0f} s to send message {sent} (a hang?): {e}")
    except Exception as e:
        failures.append(f"the writer failed at message {sent}: {type(e).__name__}: {e}")
    send_elapsed = time.monotonic() - start
    if not killed:  # the writer failed first: the victim goes anyway, it gets no "bye"
        os.kill(victim.pid, signal.SIGKILL)
        procs = {k: v for k, v in procs.items() if k != f"r{args.kill_rank}"}

    # Every reader's report (the victim has none), then the end sample while they live.
    reports: dict[int, dict[str, Any]] = {}
    for rank, c in enumerate(conns):
        if rank == args.kill_rank:
            continue
        if c.poll(2 * WAIT):
            tag, report = c.recv()
            reports[rank] = report
        else:
            failures.append(f"reader {rank} sent no report within {2 * WAIT:.0f} s")
    elapsed = time.monotonic() - start
    gc.collect()
    if warm is None:  # fewer messages than the warm-up: compare with the end only
        warm = sample(procs)
    end = sample(procs)
    arena = mq.arena_stats() or {}
    dropped = list(mq.dropped_readers)
    loan_fallbacks = mq.loan_fallbacks
    for rank, c in enumerate(conns):
        if rank != args.kill_rank:
            try:
                c.send("bye")
            except OSError:
                pass
    exit_codes = {}
    for rank, p in enumerate(readers):
        p.join(WAIT)
        if p.is_alive():
            p.kill()
            p.join(5)
        exit_codes[rank] = p.exitcode

    # The verdict.
    if victim.exitcode != -signal.SIGKILL:
        failures.append(f"reader {args.kill_rank} was to die of SIGKILL, exit code {victim.exitcode}")
    if dropped != [args.kill_rank]:
        failures.append(f"the writer dropped readers {dropped}, expected [{args.kill_rank}] (the killed one)")
    for rank, report in sorted(reports.items()):
        if exit_codes[rank] != 0:
            failures.append(f"reader {rank} exited with {exit_codes[rank]}")
        if "exception" in report:
            failures.append(f"reader {rank} failed after {report['received']} messages: {report['exception']}")
        if report["n_errors"]:
            failures.append(
                f"reader {rank}: {report['n_errors']} lost/reordered/garbled messages, first: {report['errors']}"
            )
        if report["received"] != n:
            failures.append(f"reader {rank} received {report['received']} messages of {n}")
    for rank in range(n_readers):
        if rank != args.kill_rank and rank not in reports and exit_codes[rank] != 0:
            failures.append(f"reader {rank} crashed (exit code {exit_codes[rank]})")
    shm_growth = end["shm_own_bytes"] - warm["shm_own_bytes"]
    if shm_growth > args.shm_growth_mib * MiB:
        failures.append(
            f"the soak's /dev/shm segments grew by {mib(shm_growth)} MiB (bound {args.shm_growth_mib} MiB): "
            f"{mib(warm['shm_own_bytes'])} -> {mib(end['shm_own_bytes'])} MiB, files {end['shm_own_files']}"
        )
    fs_growth = end["shm_fs_used_bytes"] - warm["shm_fs_used_bytes"]
    if args.fs_growth_mib is not None and fs_growth > args.fs_growth_mib * MiB:
        failures.append(
            f"/dev/shm's used bytes grew by {mib(fs_growth)} MiB (bound {args.fs_growth_mib} MiB): "
            f"{mib(warm['shm_fs_used_bytes'])} -> {mib(end['shm_fs_used_bytes'])} MiB"
        )
    rss_growth = {}
    for name in end["rss"]:
        before, after = warm["rss"].get(name), end["rss"][name]
        if before is None or after is None:
            failures.append(f"no RSS of {name} (pid {procs[name]}): has it died?")
            continue
        rss_growth[name] = after - before
        if after - before > args.rss_growth_mib * MiB:
            failures.append(
                f"{name}'s RSS grew by {mib(after - before)} MiB (bound {args.rss_growth_mib} MiB): "
                f"{mib(before)} -> {mib(after)} MiB"
            )

    # Shut down; then no shmq file of the soak's may be left.
    sent_by_kind = dict(sender.sent)
    mq.shutdown()
    del mq, sender
    gc.collect()
    deadline = time.monotonic() + 5.0
    while (left := own_segments(all_pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        failures.append(f"shmq files left in /dev/shm after shutdown: {sorted(left)}")

    return {
        "ok": not failures,
        "failures": failures,
        "messages": n,
        "readers": n_readers,
        "seed": args.seed,
        "killed_rank": args.kill_rank,
        "killed_after": min(args.kill_after, n),
        "dropped_readers": dropped,
        "sent_by_kind": sent_by_kind,
        "elapsed_s": round(elapsed, 3),
        "send_elapsed_s": round(send_elapsed, 3),
        "rate_msgs_per_s": round(n / elapsed, 1) if elapsed > 0 else None,
        "reports": {str(k): v for k, v in sorted(reports.items())},
        "exit_codes": {str(k): v for k, v in exit_codes.items()},
        "arena": {
            **{k: arena.get(k) for k in ("capacity", "reserved", "outstanding", "fallbacks")},
            "loan_fallbacks": loan_fallbacks,
        },
        "bounds": {
            "shm_growth_mib": args.shm_growth_mib,
            "fs_growth_mib": args.fs_growth_mib,
            "rss_growth_mib": args.rss_growth_mib,
        },
        "shm": {
            "own_warm_bytes": warm["shm_own_bytes"],
            "own_end_bytes": end["shm_own_bytes"],
            "own_growth_bytes": shm_growth,
            "own_end_files": end["shm_own_files"],
            "fs_used_warm_bytes": warm["shm_fs_used_bytes"],
            "fs_used_end_bytes": end["shm_fs_used_bytes"],
            "fs_used_growth_bytes": fs_growth,
            "left_after_shutdown": sorted(left),
        },
        "rss": {
            name: {"warm": warm["rss"].get(name), "end": end["rss"][name], "growth": rss_growth.get(name)}
            for name in end["rss"]
        },
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = run(args)
    s = summary
    log(
        f"done: {s['messages']} messages in {s['elapsed_s']:.1f} s ({s['rate_msgs_per_s']:,.0f} msg/s), "
        f"sent {s['sent_by_kind']}; dropped readers {s['dropped_readers']}; arena {s['arena']}"
    )
    log(
        f"/dev/shm (soak's segments): {mib(s['shm']['own_warm_bytes'])} -> {mib(s['shm']['own_end_bytes'])} MiB "
        f"(growth {mib(s['shm']['own_growth_bytes'])} MiB, bound {args.shm_growth_mib}); "
        f"file system used {mib(s['shm']['fs_used_warm_bytes'])} -> {mib(s['shm']['fs_used_end_bytes'])} MiB"
    )
    log("RSS MiB (warm-up -> end, growth; bound " + f"{args.rss_growth_mib}): " + ", ".join(
        f"{name} {mib(v['warm'])} -> {mib(v['end'])} ({mib(v['growth'])})" for name, v in s["rss"].items()
    ))
    if args.json:
        print(json.dumps(summary, indent=1))
    if s["ok"]:
        log("OK: nothing lost or reordered, the killed reader was dropped, /dev/shm and RSS flat, nothing left")
        return 0
    for f in s["failures"]:
        log(f"FAILED: {f}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
