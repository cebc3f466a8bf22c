"""The relay (issue 33, "one copy per node"): a writer's one remote stream serves several
readers on another machine through ``python -m shmq relay``, run as its own process.

- Every reader behind the relay gets every message whole and in order (dicts, arrays
  larger than a chunk: messages of parts), and the writer's shutdown reaches them after
  the last one (``QueueShutDownError``); the relay exits 0.
- The relay SIGKILLed is a peer death for both sides: its readers raise
  ``PeerDiedError`` (their writer died) within a bound; the writer is not held up by it
  (it goes on sending, with a warning that the relay's rank is gone).
- The writer SIGKILLed reaches the readers behind the relay as a death: the relay learns
  it at once (its connection closes), exits without shutting its queue down, and its
  readers raise ``PeerDiedError``, not ``QueueShutDownError``.
- Across two machines (network namespaces, the relay and its readers with a /dev/shm of
  their own): the same stream, and the writer's death, reach the readers behind it.

Processes over 127.0.0.1 for the first three (a relay is an ordinary remote reader: the
address does not matter); the last needs root (skipped otherwise).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import _processes
from _processes import relay_children as rc
from test_two_hosts import NS_A, NS_B, two_hosts  # noqa: F401 (a fixture)

HERE = os.path.dirname(os.path.abspath(__file__))
N_LOCAL = 3
# A dead writer is seen by a local reader's liveness check, made at least every few
# hundred ms while it waits (docs/operations.md); the relay learns the writer's death at
# once (its connection closes). Slack for a loaded 2-core machine on top.
DEATH_BOUND = 1.0
SLACK = 4.0


def _relay(handle_text: str, out_path: str, *extra: str, ns: str | None = None) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "shmq",
        "relay",
        "--handle",
        handle_text,
        "--rank",
        "0",
        "--local-readers",
        str(N_LOCAL),
        "--out",
        out_path,
        "--timeout",
        str(rc.STEP),
        *extra,
    ]
    if ns is not None:
        script = "mount -t tmpfs -o size=256m tmpfs /dev/shm && exec " + " ".join(cmd)
        cmd = ["ip", "netns", "exec", ns, "unshare", "-m", "sh", "-c", script]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _processes.CHILD_PIDS.add(p.pid)
    return p


def _wait_file(path: str, proc: subprocess.Popen, who: str = "the relay") -> str:
    with open(_processes.wait_for_file(path, rc.STEP, f"{who}'s handle", {who: proc})) as f:
        return f.read().strip()


@pytest.fixture
def behind_relay(children, tmp_path):
    """A writer child (one remote reader), a relay process for it, and N_LOCAL readers
    of the relay, all ready: (writer's out queue, its commands, its pid, relay, readers'
    out queue, how many messages each reader has read so far)."""
    out, cmds = children.queue(), children.queue()
    children.start(rc.writer, out, "127.0.0.1", cmds)
    _, text, writer_pid = children.expect(out, "handle")
    relay = _relay(text, str(tmp_path / "relay.handle"))
    try:
        local = _wait_file(str(tmp_path / "relay.handle"), relay)
        readers = children.queue()
        progress = _processes.CTX.Array("q", N_LOCAL)
        for rank in range(N_LOCAL):
            children.start(rc.reader, readers, local, rank, progress)
        for _ in range(N_LOCAL):
            children.expect(readers, "joined")
        children.expect(out, "ready")
        yield out, cmds, writer_pid, relay, readers, progress
    finally:
        if relay.poll() is None:
            relay.kill()
        relay.communicate(timeout=rc.STEP)


def _have_read(progress, n: int) -> None:
    """Wait until every reader behind the relay has read ``n`` messages."""
    _processes.wait_for(lambda: all(k >= n for k in progress[:]), rc.STEP, f"every reader to read {n} messages")


def _done(children, readers) -> dict[int, tuple]:
    reports = [children.expect(readers, "done", timeout=rc.STEP * 2) for _ in range(N_LOCAL)]
    return {r[1]: r[2:] for r in reports}


@pytest.mark.timeout(150)
def test_readers_behind_a_relay_get_every_message_and_the_writers_shutdown(children, behind_relay):
    out, cmds, _, relay, readers, _ = behind_relay
    cmds.put(("send", 0, rc.N_OBJECTS))
    children.expect(out, "sent")
    cmds.put("shutdown")
    done = _done(children, readers)
    for rank, (got, good, error, text, _) in done.items():
        assert got == list(range(rc.N_OBJECTS)), (rank, got)
        assert good, rank
        assert error == "QueueShutDownError", (rank, error, text)
    _, err = relay.communicate(timeout=rc.STEP)
    assert relay.returncode == 0, err[-3000:]
    assert f"{rc.N_OBJECTS} messages" in err and "the upstream writer shut down" in err, err


@pytest.mark.timeout(150)
def test_a_killed_relay_is_a_dead_writer_to_its_readers_and_a_gone_reader_to_the_writer(children, behind_relay):
    out, cmds, _, relay, readers, progress = behind_relay
    cmds.put(("send", 0, 20))
    children.expect(out, "sent")
    _have_read(progress, 20)  # the readers take the 20 and wait for more
    os.kill(relay.pid, signal.SIGKILL)
    killed = time.monotonic()
    done = _done(children, readers)
    for rank, (got, good, error, text, at) in done.items():
        assert got == list(range(20)) and good, (rank, got)
        assert error == "PeerDiedError", (rank, error, text)
        assert "died" in text, text
        assert at - killed < DEATH_BOUND + SLACK, f"rank {rank}: {at - killed:.2f} s"
    # The writer goes on without it: nothing holds its sends up (with the default
    # slow_remote_reader="block", a reader it still waited for would).
    cmds.put(("send", 20, 40))
    _, took, warnings = children.expect(out, "sent")
    assert took < SLACK, f"{took:.2f} s"
    assert any("remote reader rank 0" in w and "is gone" in w for w in warnings), warnings
    cmds.put(None)


@pytest.mark.timeout(150)
def test_the_writers_death_reaches_the_readers_behind_the_relay_as_a_death(children, behind_relay):
    out, cmds, writer_pid, relay, readers, progress = behind_relay
    cmds.put(("send", 0, 20))
    children.expect(out, "sent")
    _have_read(progress, 20)
    os.kill(writer_pid, signal.SIGKILL)
    killed = time.monotonic()
    _, err = relay.communicate(timeout=rc.STEP)
    assert relay.returncode == 3, err[-3000:]
    assert "PeerDiedError" in err and "is gone" in err, err
    done = _done(children, readers)
    for rank, (got, good, error, text, at) in done.items():
        assert got == list(range(20)) and good, (rank, got)
        # A death, not a shutdown: the relay left its queue as a dead writer does.
        assert error == "PeerDiedError", (rank, error, text)
        assert at - killed < 2 * DEATH_BOUND + SLACK, f"rank {rank}: {at - killed:.2f} s"
    [_processes.CHILD_PIDS.discard(p) for p in (writer_pid,)]


def _in_ns(ns: str, role: str, workdir: str, *extra: str, own_shm: bool) -> subprocess.Popen:
    python = [sys.executable, os.path.join(HERE, "_processes", "relay_children.py"), role, workdir, *extra]
    if own_shm:
        script = "mount -t tmpfs -o size=256m tmpfs /dev/shm && exec " + " ".join(python)
        cmd = ["ip", "netns", "exec", ns, "unshare", "-m", "sh", "-c", script]
    else:
        cmd = ["ip", "netns", "exec", ns, *python]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.timeout(180)
def test_a_relay_on_another_host_serves_its_readers_and_passes_the_writers_death_on(
    two_hosts,  # noqa: F811
    tmp_path,
):
    """Host A: the writer (one remote reader). Host B (its own /dev/shm): the relay and
    two readers, which share host B's /dev/shm: one mount namespace for the three, made
    by a shell that starts them all."""
    workdir = str(tmp_path)
    writer = _in_ns(NS_A, "writer", workdir, own_shm=False)
    procs = {"writer": writer}
    try:
        text = _wait_file(os.path.join(workdir, "writer.handle"), writer, "the writer")
        py = sys.executable
        script = os.path.join(HERE, "_processes", "relay_children.py")
        relay_out = os.path.join(workdir, "relay.handle")
        host_b = (
            "mount -t tmpfs -o size=256m tmpfs /dev/shm && "
            f"({py} -m shmq relay --handle '{text}' --rank 0 --local-readers 2 --out {relay_out} "
            f"--timeout {rc.STEP} > {workdir}/relay.out 2> {workdir}/relay.err; "
            f"echo $? > {workdir}/relay.status) & "
            f"{py} {script} reader {workdir} 0 > {workdir}/r0.out 2> {workdir}/r0.err & "
            f"{py} {script} reader {workdir} 1 > {workdir}/r1.out 2> {workdir}/r1.err & "
            "wait"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
        b = subprocess.Popen(
            ["ip", "netns", "exec", NS_B, "unshare", "-m", "sh", "-c", host_b],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        procs["host B"] = b
        _processes.wait_for_file(os.path.join(workdir, "sent"), 60, "the writer to send its stream", procs)
        # The stream reaches host B's readers: each says so with a file.
        got = [os.path.join(workdir, f"r{rank}.got") for rank in (0, 1)]
        _processes.wait_for(lambda: all(map(os.path.exists, got)), 60, "host B's readers to read the stream")
        writer.kill()
        killed = time.monotonic()
        b.communicate(timeout=60)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=10)
    with open(os.path.join(workdir, "relay.status")) as f:
        assert f.read().strip() == "3", open(os.path.join(workdir, "relay.err")).read()[-3000:]
    for rank in (0, 1):
        with open(os.path.join(workdir, f"r{rank}.out")) as f:
            lines = f.read().strip().splitlines()
        assert lines, open(os.path.join(workdir, f"r{rank}.err")).read()[-3000:]
        r = json.loads(lines[-1])
        assert r["got"] == list(range(rc.N_OBJECTS)) and r["good"], r
        assert r["error"][0] == "PeerDiedError", r["error"]
        assert r["at"] - killed < 2 * DEATH_BOUND + SLACK, f"{r['at'] - killed:.2f} s"
