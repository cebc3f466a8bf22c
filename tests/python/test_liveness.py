"""Liveness of MessageQueue: an idle waiter sleeps (no CPU) and still wakes at once; a
dead peer (a reader the writer waits for, or the writer a reader waits for) ends the
wait with ``PeerDiedError`` instead of a hang; shutdown() and cancel events wake
sleepers; the spin/yield wait policy (arguments and ``SHMQ_SPIN_US`` /
``SHMQ_YIELD_US``) and ``on_dead_reader`` are validated.

Every blocking call has a timeout or runs under a join/receive timeout, so a broken
queue fails a test instead of hanging it. Segments created by children that a test
kills (and so never remove their segment) are removed by that test.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import shmq
import shmq.admin
from shmq import MessageQueue, PeerDiedError, QueueShutDownError

from _processes import (
    shmq_cli,
    SHM_DIR,
    STEP,
    blocked_in_queue,
    doomed_writer,
    env_policy_reader,
    idle_cpu_reader,
    load_policy_reader,
    orphan_reader,
    segment_creator,
    segment_creator_pid,
    sequence_reader,
    wait_for,
)

# A dead peer is checked for about twice a second; "within a few seconds" allows for a
# busy machine.
DEATH_NOTICED_WITHIN = 10.0
# Liveness bound for a wake-up from another thread (not a benchmark).
WAKE_WITHIN = 1.0


def _sigkill(proc) -> float:
    """SIGKILL ``proc`` and return when (time.monotonic()). It is not reaped here: a
    killed but unreaped child (a zombie) must count as dead too."""
    os.kill(proc.pid, signal.SIGKILL)
    return time.monotonic()


def _remove_segment(name: str) -> None:
    """Remove what a killed creator left: the segment, and a ring's socket directory."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass
    shutil.rmtree(os.path.join(SHM_DIR, name + ".sock"), ignore_errors=True)


# ---------------------------------------------------------------------------------
# An idle reader sleeps, and wakes when a message comes


def test_idle_reader_uses_no_cpu_and_wakes_for_a_late_message(children):
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=4)
    out = children.queue()
    children.start(idle_cpu_reader, out, mq.export_handle(), 0)
    mq.wait_until_ready(timeout=STEP)
    children.expect(out, "ready")

    _, outcome, cpu, wall = children.expect(out, "idle")
    assert outcome[0] == "TimeoutError", outcome
    assert 2.9 <= wall < 3.0 + 10, wall
    idle_fraction = cpu / wall
    print(f"\nidle reader in dequeue(timeout=3): {cpu * 1e3:.1f} ms CPU over {wall:.2f} s = {idle_fraction:.2%}")
    assert idle_fraction < 0.05, f"an idle reader used {idle_fraction:.1%} of a CPU ({cpu:.3f} s in {wall:.2f} s)"

    _, waiting_since = children.expect(out, "waiting")
    # Not synchronisation: the reader is to idle 2 s in dequeue() before the message comes.
    time.sleep(max(0.0, waiting_since + 2.0 - time.monotonic()))
    sent = time.monotonic()  # CLOCK_MONOTONIC: the same clock in every process
    mq.enqueue(("late", sent), timeout=STEP)
    _, obj, received, cpu, wall = children.expect(out, "late")
    assert obj == ("late", sent)
    latency = received - sent
    fraction = cpu / wall
    print(
        f"message sent after {sent - waiting_since:.2f} s of idleness: received {latency * 1e6:.0f} µs later; "
        f"reader used {cpu * 1e3:.1f} ms CPU over {wall:.2f} s = {fraction:.2%}"
    )
    assert 0 <= latency < 2.0, latency  # a sanity bound, not a benchmark
    assert fraction < 0.05, f"a reader waiting 2 s used {fraction:.1%} of a CPU"
    children.join()


# ---------------------------------------------------------------------------------
# A local reader dies mid-stream


def _stream_until_the_victim_dies(children, on_dead_reader: str, n: int):
    """Writer (here) with three local readers and a 4-chunk ring; reader 1 reads slowly
    and is SIGKILLed mid-stream by another thread while the writer keeps enqueueing
    ``0..n-1`` (each with a 60 s timeout, so nothing can hang). Returns the writer, the
    victim, the live readers' report queues, the stop event, the kill time, and the
    outcome ``(index, exception or None, when)`` of the stream."""
    mq = MessageQueue(n_reader=3, n_local_reader=3, max_chunk_bytes=1024, max_chunks=4, on_dead_reader=on_dead_reader)
    handle = mq.export_handle()
    stop = children.event()
    victim_out = children.queue()
    live_outs = {0: children.queue(), 2: children.queue()}
    children.start(sequence_reader, live_outs[0], handle, 0, stop, 0.0, 0)
    victim = children.start(sequence_reader, victim_out, handle, 1, stop, 0.01, 10)
    children.start(sequence_reader, live_outs[2], handle, 2, stop, 0.0, 0)
    mq.wait_until_ready(timeout=STEP)
    for rank, out in (*live_outs.items(), (1, victim_out)):
        assert children.expect(out, "ready")[1] == rank

    killed_at: list[float] = []
    killer_error: list[BaseException] = []

    def killer() -> None:
        try:
            children.expect(victim_out, "progress")  # it has read 10 messages
            wait_for(lambda: blocked_in_queue(mq.buffer.name), STEP, "the writer blocked on the slow reader")
            killed_at.append(_sigkill(victim))
        except BaseException as e:  # pragma: no cover - reported by the test
            killer_error.append(e)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    failure = None
    i = 0
    for i in range(n):
        try:
            mq.enqueue(i, timeout=60)
        except BaseException as e:
            failure = e
            break
    else:
        i = n
    ended = time.monotonic()
    t.join(STEP)
    assert not killer_error, killer_error
    assert killed_at, "the victim was never killed"
    victim.join(STEP)
    assert victim.exitcode == -signal.SIGKILL, victim.exitcode
    children.procs.remove(victim)
    return mq, victim, live_outs, stop, killed_at[0], (i, failure, ended)


def test_writer_raises_peer_died_error_when_a_reader_is_killed(children):
    assert issubclass(PeerDiedError, RuntimeError)
    assert shmq.PeerDiedError is PeerDiedError and "PeerDiedError" in shmq.__all__
    n = 2000  # the victim would need 20 s to read them all: it dies long before
    mq, victim, live_outs, stop, killed_at, (sent, failure, ended) = _stream_until_the_victim_dies(children, "raise", n)
    assert failure is not None, f"the writer sent all {n} messages although reader 1 was dead"
    assert isinstance(failure, PeerDiedError), repr(failure)
    message = str(failure)
    assert "reader 1" in message and f"pid {victim.pid}" in message, message
    noticed = ended - killed_at
    print(f"\nreader 1 killed after {sent} messages were sent; the writer raised {noticed:.2f} s later: {message}")
    assert noticed < DEATH_NOTICED_WITHIN, noticed
    assert sent >= 10
    # The reader is still dead: the next enqueue raises too instead of hanging.
    with pytest.raises(PeerDiedError, match=f"pid {victim.pid}"):
        mq.enqueue("after the death", timeout=STEP)
    assert mq.dropped_readers == []
    # The live readers got exactly what was sent: a failed enqueue publishes nothing.
    stop.set()
    for rank, out in live_outs.items():
        _, r, got = children.expect(out, "got")
        assert r == rank
        assert got == list(range(sent)), f"reader {rank} got {len(got)} messages, expected 0..{sent - 1}"
    children.join()


def test_writer_drops_a_killed_reader_and_goes_on(children):
    n = 600
    mq, victim, live_outs, stop, killed_at, (sent, failure, ended) = _stream_until_the_victim_dies(children, "drop", n)
    assert failure is None, f"enqueue {sent} failed: {failure!r}"
    assert sent == n
    mq.enqueue(None, timeout=60)  # the live readers stop at None
    assert mq.dropped_readers == [1]
    for rank, out in live_outs.items():
        _, r, got = children.expect(out, "got")
        assert r == rank
        assert got == list(range(n)), f"reader {rank} got {len(got)} messages, not 0..{n - 1} in order"
    children.join()
    print(f"\nreader 1 (pid {victim.pid}) dropped; writer finished {ended - killed_at:.2f} s after the kill")


# ---------------------------------------------------------------------------------
# The writer dies


@pytest.mark.timeout(90)
@pytest.mark.parametrize("policy", [(None, None), (0, 0)], ids=["default-policy", "sleep-at-once"])
def test_reader_raises_peer_died_error_when_the_writer_is_killed(children, policy):
    writer_out, reader_out = children.queue(), children.queue()
    writer = children.start(doomed_writer, writer_out, 2)
    handle = children.expect(writer_out, "handle")[1]
    name = handle.buffer_handle[3]
    try:
        reader = children.start(orphan_reader, reader_out, handle, 0, 2, *policy)
        children.expect(writer_out, "sent")
        assert children.expect(reader_out, "waiting")[1] == [0, 1]
        # The reader is asleep in dequeue() (no timeout): blocked past its spin and yield.
        wait_for(lambda: blocked_in_queue(name, 0, for_at_least=0.1), STEP, "the reader asleep in dequeue()")
        killed_at = _sigkill(writer)
        _, outcome, ended = children.expect(reader_out, "ended", timeout=STEP)
        reader.join(STEP)
        assert reader.exitcode == 0, reader.exitcode
        writer.join(STEP)
        children.procs.remove(writer)
    finally:
        _remove_segment(name)  # the killed writer could not
        _remove_segment(handle.arena_name)
    assert outcome["type"] == "PeerDiedError", outcome
    assert outcome["is_peer_died"] and outcome["is_runtime_error"], outcome
    assert f"the writer (pid {writer.pid}) died" in outcome["message"], outcome
    noticed = ended - killed_at
    print(f"\nthe reader noticed the writer's death {noticed:.2f} s after the kill: {outcome['message']}")
    assert noticed < DEATH_NOTICED_WITHIN, noticed
    children.join()


@pytest.mark.parametrize("janitor", [True, False], ids=["janitor", "SHMQ_NO_JANITOR"])
def test_a_killed_creators_segments_go_with_its_janitor_and_stay_without(children, janitor):
    # A creator killed with SIGKILL runs no exit hook: its janitor (shmq._janitor)
    # removes its segments; without one (SHMQ_NO_JANITOR=1), they stay in /dev/shm until
    # someone removes them (cleanup; here, this test).
    out = children.queue()
    creator = children.start(segment_creator, out, janitor)
    handle = children.expect(out, "handle")[1]
    name = handle.buffer_handle[3]
    path = os.path.join(SHM_DIR, name)
    arena = os.path.join(SHM_DIR, handle.arena_name)
    try:
        assert segment_creator_pid(name) == creator.pid, name
        assert os.path.exists(path)
        creator.kill()
        creator.join(STEP)
        assert creator.exitcode == -signal.SIGKILL
        children.procs.remove(creator)
        if janitor:
            wait_for(
                lambda: not os.path.exists(path) and not os.path.exists(arena),
                STEP,
                "the janitor to remove the killed creator's segments (it left them)",
            )
            assert not os.path.exists(path) and not os.path.exists(arena), "the janitor left them"
        else:
            assert os.path.exists(path), f"{path} vanished although its creator was SIGKILLed"
            assert os.path.exists(arena)
    finally:
        _remove_segment(name)
        _remove_segment(handle.arena_name)
    assert not os.path.exists(path)


def test_cleanup_removes_a_killed_creators_segment_and_keeps_live_ones(children):
    live = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    live_path = os.path.join(SHM_DIR, live.buffer.name)
    out = children.queue()
    creator = children.start(segment_creator, out)
    handle = children.expect(out, "handle")[1]
    name, arena = handle.buffer_handle[3], handle.arena_name
    path = os.path.join(SHM_DIR, name)
    try:
        creator.kill()
        creator.join(STEP)
        children.procs.remove(creator)
        assert os.path.exists(path)

        dry = shmq_cli("cleanup", "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert f"would remove {name}" in dry.stdout
        assert live.buffer.name not in dry.stdout
        assert os.path.exists(path), "--dry-run removed a segment"

        done = shmq_cli("cleanup")
        assert done.returncode == 0, done.stderr
        assert f"removed {name}" in done.stdout
        assert f"removed {arena}" in done.stdout
        assert not os.path.exists(path), f"cleanup left {path}"
        assert not os.path.exists(path + ".sock"), "cleanup left the ring's socket directory"
        assert not os.path.exists(os.path.join(SHM_DIR, arena)), "cleanup left the tensor arena"
        assert os.path.exists(live_path), "cleanup removed a live process's segment"
        assert name not in [s.name for s in shmq.admin.list_segments()]
    finally:
        _remove_segment(name)
        _remove_segment(arena)


def test_inspect_shows_the_writer_readers_and_chunks(children):
    # No arena: a message over a chunk then goes through the overflow socket.
    mq = MessageQueue(n_reader=2, n_local_reader=2, max_chunk_bytes=64, max_chunks=3, arena_bytes=0)
    reader = MessageQueue.create_from_handle(mq.export_handle(), 1)
    mq.enqueue("x")
    mq.enqueue(b"y" * 100)  # over a chunk: through the overflow socket
    shown = shmq_cli("inspect", mq.buffer.name)
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    me = os.getpid()
    assert "broadcast ring, 2 readers, 3 chunks of 64 bytes" in text
    assert f"writer: pid {me} (alive), 2 messages written, 1 sent over the overflow socket" in text
    assert "reader 0: nobody, 0 messages read" in text
    assert f"reader 1: pid {me} (alive), 0 messages read" in text
    assert "chunk 0: written, read by []" in text
    del reader
    missing = shmq_cli("inspect", "shmq_ring_1_doesnotexist")
    assert missing.returncode == 1 and "does not exist on this machine" in missing.stderr


# ---------------------------------------------------------------------------------
# shutdown() and cancel events wake a sleeping waiter


@pytest.mark.parametrize("policy", [(None, None), (0, 0)], ids=["default-policy", "sleep-at-once"])
@pytest.mark.parametrize("how", ["shutdown", "event", "event-indefinite"])
def test_sleeping_reader_is_woken_by_another_thread(policy, how):
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    reader = MessageQueue.create_from_handle(mq.export_handle(), 0, spin_us=policy[0], yield_us=policy[1])
    ev = threading.Event()
    fired_at: list[float] = []

    def fire() -> None:
        fired_at.append(time.monotonic())
        if how == "shutdown":
            reader.shutdown()
        else:
            ev.set()

    timer = threading.Timer(0.6, fire)  # ≥ 0.5 s: past the spin and yield phases
    timer.start()
    t0, cpu0 = time.monotonic(), time.thread_time()
    try:
        with pytest.raises(RuntimeError, match="^cancelled$"):
            if how == "shutdown":
                reader.dequeue(timeout=STEP)
            else:
                reader.dequeue(timeout=STEP, cancel=ev, indefinite=how == "event-indefinite")
        ended, cpu = time.monotonic(), time.thread_time() - cpu0
    finally:
        timer.cancel()
        timer.join(STEP)
    assert fired_at
    latency = ended - fired_at[0]
    print(f"\nwoken {latency * 1e3:.1f} ms after {how}; {cpu * 1e3:.1f} ms CPU in {ended - t0:.2f} s of waiting")
    assert ended - t0 >= 0.55  # it really waited for the other thread
    assert latency < WAKE_WITHIN, latency
    assert cpu < 0.5 * (ended - t0), f"the waiting thread used {cpu:.3f} s CPU: it did not sleep"
    if how != "shutdown":
        # A cancelled dequeue loses nothing.
        mq.enqueue("after the cancel", timeout=STEP)
        assert reader.dequeue(timeout=STEP) == "after the cancel"


@pytest.mark.parametrize("policy", [(None, None), (0, 0)], ids=["default-policy", "sleep-at-once"])
def test_sleeping_writer_on_a_full_ring_is_woken_by_shutdown(policy):
    mq = MessageQueue(
        n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2, spin_us=policy[0], yield_us=policy[1]
    )
    reader = MessageQueue.create_from_handle(mq.export_handle(), 0)  # alive, never reads
    mq.enqueue("m0", timeout=STEP)
    mq.enqueue("m1", timeout=STEP)  # the ring is full
    fired_at: list[float] = []

    def fire() -> None:
        fired_at.append(time.monotonic())
        mq.shutdown()

    timer = threading.Timer(0.6, fire)
    timer.start()
    t0, cpu0 = time.monotonic(), time.thread_time()
    try:
        # The writer's own shutdown() ends the queue: a RuntimeError that says so.
        with pytest.raises(QueueShutDownError, match="the queue was shut down") as info:
            mq.enqueue("blocked", timeout=STEP)
        ended, cpu = time.monotonic(), time.thread_time() - cpu0
    finally:
        timer.cancel()
        timer.join(STEP)
    assert not isinstance(info.value, PeerDiedError)
    assert fired_at
    latency = ended - fired_at[0]
    print(f"\nwriter woken {latency * 1e3:.1f} ms after shutdown; {cpu * 1e3:.1f} ms CPU in {ended - t0:.2f} s")
    assert ended - t0 >= 0.55
    assert latency < WAKE_WITHIN, latency
    assert cpu < 0.5 * (ended - t0), f"the waiting writer used {cpu:.3f} s CPU: it did not sleep"
    assert mq.shutting_down is True
    # What was sent before is intact.
    assert [reader.dequeue(timeout=STEP) for _ in range(2)] == ["m0", "m1"]


# ---------------------------------------------------------------------------------
# Validation of the wait policy and on_dead_reader


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan")])
@pytest.mark.parametrize("arg", ["spin_us", "yield_us"])
def test_bad_wait_policy_is_a_value_error(arg, bad):
    with pytest.raises(ValueError, match=arg):
        MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2, **{arg: bad})
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    with pytest.raises(ValueError, match=arg):
        MessageQueue.create_from_handle(mq.export_handle(), 0, **{arg: bad})


def test_zero_wait_policy_is_accepted():
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2, spin_us=0, yield_us=0)
    reader = MessageQueue.create_from_handle(mq.export_handle(), 0, spin_us=0, yield_us=0.0)
    mq.enqueue("x", timeout=STEP)
    assert reader.dequeue(timeout=STEP) == "x"


@pytest.mark.parametrize("bad", ["bogus", "RAISE", ""])
def test_bad_on_dead_reader_is_a_value_error(bad):
    with pytest.raises(ValueError, match="on_dead_reader"):
        MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2, on_dead_reader=bad)


@pytest.mark.parametrize("good", ["raise", "drop"])
def test_on_dead_reader_values(good):
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2, on_dead_reader=good)
    assert mq.dropped_readers == []


# ---------------------------------------------------------------------------------
# SHMQ_SPIN_US / SHMQ_YIELD_US


@pytest.mark.parametrize(
    "env",
    [{"SHMQ_SPIN_US": "200000", "SHMQ_YIELD_US": "0"}, {"SHMQ_SPIN_US": "0", "SHMQ_YIELD_US": "200000"}],
    ids=["spin", "yield"],
)
def test_wait_policy_env_vars(children, env):
    # The policy as the variables say, however busy the machine running the suite is (on
    # a full one a blocked waiter would go straight to its futex: SHMQ_LOAD_CHECK).
    env = {**env, "SHMQ_LOAD_CHECK": "0"}
    mq = MessageQueue(n_reader=2, n_local_reader=2, max_chunk_bytes=1024, max_chunks=2)
    out = children.queue()
    children.start(env_policy_reader, out, mq.export_handle(), env, (0, 1))
    mq.wait_until_ready(timeout=STEP)
    busy = children.expect(out, "busy")[1]
    mq.enqueue("works", timeout=STEP)
    assert children.expect(out, "got")[1:] == ("works", "works")
    children.join()
    print(f"\n{env}: dequeue(timeout=0.4), thread busy (outcome, busy s, wall s): {busy}")
    env_outcome, env_busy, _ = busy["env"]
    explicit_outcome, explicit_busy, _ = busy["explicit"]
    assert env_outcome == explicit_outcome == "TimeoutError", busy
    # A waiter that spins or yields for 200 ms (the environment's policy) stays busy
    # (running or runnable) that long; the other reader's explicit spin_us=0,
    # yield_us=0 overrides the environment and sleeps at once.
    assert env_busy >= 0.12, busy
    # Busy counts runnable time too, which a loaded machine (the suite's other worker)
    # inflates for both: the explicit reader is busy less than half as long, and short.
    assert explicit_busy < min(0.15, env_busy / 2), busy


# ---------------------------------------------------------------------------------
# A full machine: a blocked waiter sleeps instead of spinning (SHMQ_LOAD_CHECK)


def _runnable_tasks() -> int:
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[0])


def test_a_waiter_on_a_full_machine_sleeps_instead_of_spinning(children):
    """With more runnable tasks than cores (busy loops in other processes, at nice 19 so
    that the readers keep most of their share), two readers whose policy says "spin 1 s"
    wait 1.2 s for a message that does not come: the one with the load check sleeps
    once it has read the machine full twice (about 5 ms apart) and uses almost no CPU,
    the one with SHMQ_LOAD_CHECK=0 spins, taking what CPU it gets for its whole spin.
    CPU time, not a latency; the spin is long so that a spinner starved by the suite's
    other work still takes far more than the sleeper."""
    cores = os.sysconf("SC_NPROCESSORS_ONLN")
    if cores > 16:
        pytest.skip(f"{cores} cores: filling them takes more busy processes than this test starts")
    burners = [
        subprocess.Popen([sys.executable, "-c", "import os; os.nice(19)\nwhile True: pass"])
        for _ in range(cores + 2)
    ]
    try:
        # The machine is full once the burners run (each is runnable all the time).
        deadline = time.monotonic() + STEP
        while _runnable_tasks() <= cores:
            if time.monotonic() > deadline:
                pytest.skip(f"/proc/loadavg never showed more than {cores} runnable tasks")
            time.sleep(0.05)
        mq = MessageQueue(n_reader=2, n_local_reader=2, max_chunk_bytes=1024, max_chunks=2)
        out = children.queue()
        env = {"SHMQ_SPIN_US": "1000000", "SHMQ_YIELD_US": "0"}
        children.start(load_policy_reader, out, mq.export_handle(), env, 0, 1.2)
        children.start(load_policy_reader, out, mq.export_handle(), {**env, "SHMQ_LOAD_CHECK": "0"}, 1, 1.2)
        mq.wait_until_ready(timeout=STEP)
        cpu = {}
        for _ in range(2):
            _, rank, outcome, seconds = children.expect(out, "cpu")
            cpu[rank] = (outcome, seconds)
        mq.enqueue("works", timeout=STEP)
        got = sorted(children.expect(out, "got")[1:] for _ in range(2))
        children.join()
    finally:
        for b in burners:
            b.kill()
            b.wait()
    print(f"\nCPU s in dequeue(timeout=1.2), check on (0) / off (1): {cpu}")
    assert got == [(0, "works"), (1, "works")]
    assert cpu[0][0] == cpu[1][0] == "TimeoutError", cpu
    # Off: a 1 s spin, on a core shared with the busy loops (measured here: 0.48 s at
    # nice 19 beside them and other work). On: the check reads the machine about every
    # 5 ms and wants two full readings, then the reader sleeps (measured: 0.006 s).
    assert cpu[1][1] >= 0.1, cpu
    assert cpu[0][1] < min(0.05, cpu[1][1] / 4), cpu
