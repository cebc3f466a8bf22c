"""Issue 54, a sixth hostile round: nobody let in, nothing lost.

1. Another local user (nobody) creates ``/dev/shm/shmq_ec_<name>`` under a victim's
   encoder-cache name and saves an entry whose pickle runs a command: the victim's
   consumer opened the segment without checking whose it was and unpickled the entry in
   ``load()`` (the command ran as the victim, root included), and the victim's producer
   refused to start ("already served by a live producer"). Every segment open now checks
   the file's owner and mode on the descriptor it opened: another user's segment, or one
   others may write, is a ``PermissionError`` naming the owner, and nothing in it is
   read.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from shmq import MessageQueue
from shmq.encoder_cache import EncoderCacheConsumer, EncoderCacheIndex, EncoderCacheProducer

SHM = Path("/dev/shm")
NOBODY = 65534

# The stranger: imports what it needs as root (the interpreter's files may be unreadable
# to nobody), becomes nobody, makes an encoder cache under the victim's name and saves an
# entry whose unpickling runs a command, then waits until told to go.
STRANGER = textwrap.dedent(
    """
    import concurrent.futures.thread, os, subprocess, sys
    import shmq
    from shmq.encoder_cache import EncoderCacheProducer

    class Payload:
        def __reduce__(self):
            return (subprocess.call, (["touch", sys.argv[2]],))

    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    p = EncoderCacheProducer(sys.argv[1], capacity=1 << 20, max_entries=8, timeout=5)
    p.save("image-0", {"embedding": Payload()})
    p.flush(timeout=10)
    print("saved", flush=True)
    sys.stdin.read()
    p.close()
    """
)


@pytest.fixture
def stranger_cache(tmp_path):
    """An encoder cache of user nobody under a fresh name, with a poisoned entry; yields
    (name, the file its payload would create)."""
    if os.geteuid() != 0:
        pytest.skip("the stranger runs as user nobody: the test must run as root to switch to it")
    name = f"victim-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "pwned"
    os.chmod(tmp_path, 0o777)  # the payload, as nobody, could write here: proof it ran
    env = dict(os.environ, SHMQ_NO_JANITOR="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", STRANGER, name, str(marker)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline().strip()
        if line != "saved":
            pytest.fail(f"the stranger did not start: {line!r}, exit {proc.poll()}")
        assert (SHM / f"shmq_ec_{name}").stat().st_uid == NOBODY
        yield name, marker
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        (SHM / f"shmq_ec_{name}").unlink(missing_ok=True)


def test_a_strangers_encoder_cache_under_the_victims_name_is_refused_and_never_unpickled(stranger_cache):
    name, marker = stranger_cache
    # The victim's consumer (a process of its own, as a vLLM worker is).
    code = textwrap.dedent(
        """
        import sys
        from shmq.encoder_cache import EncoderCacheConsumer, EncoderCacheIndex
        for make in (EncoderCacheConsumer, EncoderCacheIndex):
            try:
                c = make(sys.argv[1])
            except PermissionError as e:
                print("refused:", e)
                continue
            print("opened", c.get("image-0") if hasattr(c, "get") else c.has("image-0"))
        """
    )
    out = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("refused:") for line in lines), out.stdout
    assert f"'shmq_ec_{name}' belongs to another user (uid {NOBODY}" in lines[0], lines[0]
    assert not marker.exists(), "the stranger's pickle ran in the victim's process"
    # In this process too, and for the victim's own producer, which names the owner.
    with pytest.raises(PermissionError, match=f"uid {NOBODY}"):
        EncoderCacheConsumer(name)
    with pytest.raises(PermissionError, match=f"uid {NOBODY}"):
        EncoderCacheIndex(name)
    with pytest.raises(PermissionError, match=f"belongs to another user \\(uid {NOBODY}"):
        EncoderCacheProducer(name, capacity=1 << 20)
    assert not marker.exists()


def test_a_queue_segment_given_to_another_user_or_opened_to_others_is_refused_by_readers():
    """The same check for every kind: a queue's ring whose file was handed to another user
    (or made writable by others) after the writer made it is refused by a reader that
    opens it, with the owner named."""
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    q = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    segment = SHM / q.handle.buffer_handle[3]
    assert segment.exists(), segment
    code = (
        "import sys; from shmq import Handle, MessageQueue; "
        "MessageQueue.create_from_handle(Handle.from_str(sys.argv[1]), 0)"
    )
    text = str(q.export_handle())
    try:
        for change in ("mode", "owner"):
            if change == "mode":
                os.chmod(segment, 0o666)
                expected = "is open to other users (mode 0666"
            else:
                os.chmod(segment, 0o600)
                os.chown(segment, NOBODY, NOBODY)
                expected = f"belongs to another user (uid {NOBODY}"
            out = subprocess.run([sys.executable, "-c", code, text], capture_output=True, text=True, timeout=60)
            assert out.returncode != 0
            assert "PermissionError" in out.stderr and expected in out.stderr, out.stderr[-2000:]
    finally:
        os.chown(segment, 0, 0)
        os.chmod(segment, 0o600)
        q.shutdown()
        del q


# ------------------------------------------------------------------------------------
# 11. A named encoder cache outlives its crashed producer only while someone holds it.

PRODUCER = textwrap.dedent(
    """
    import sys, torch
    from shmq.encoder_cache import EncoderCacheProducer
    p = EncoderCacheProducer(sys.argv[1], capacity=4 << 20, max_entries=8, timeout=5)
    p.save("image-0", torch.full((1024,), 3.0))
    p.flush(timeout=30)
    print("saved", flush=True)
    sys.stdin.read()
    """
)


def _producer(name: str) -> subprocess.Popen:
    """A producer of cache ``name`` (a process of its own, with its janitor) that saved
    one key and waits."""
    proc = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    if proc.stdout.readline().strip() != "saved":
        proc.kill()
        proc.wait(timeout=30)
        pytest.fail("the producer did not start")
    return proc


def _sigkill(proc: subprocess.Popen) -> None:
    """SIGKILL, as vLLM's shutdown kills a worker that lingers."""
    proc.kill()
    proc.wait(timeout=30)


def _gone(path: Path, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_sigkilled_producers_named_cache_goes_once_nobody_holds_it(cache_name):
    """Issue 54 item 11: ``vllm serve`` with shmq's connector, stopped with SIGTERM, left
    ``/dev/shm/shmq_ec_<name>`` (1 GiB apparent) in 7 of 17 stops: vLLM SIGKILLs its
    workers, the producer lives in one, and its named cache was kept for consumers that
    might still read it — also when there were none. Now its janitor removes it once no
    process holds it any more."""
    segment = SHM / f"shmq_ec_{cache_name}"
    # Nobody else holds it: gone once its producer is.
    _sigkill(_producer(cache_name))
    assert _gone(segment), f"{segment} was left by a SIGKILLed producer that nobody else held"
    # A consumer joined (a prefill/decode worker): it stays, and the saved key loads,
    # until that consumer leaves; then it goes.
    producer = _producer(cache_name)
    consumer = EncoderCacheConsumer(cache_name)
    assert consumer.has("image-0")
    _sigkill(producer)
    time.sleep(0.5)  # not synchronisation: time for a wrong removal to happen
    assert segment.exists(), "the cache went while a consumer still held it"
    value = consumer.get("image-0")
    assert float(value.sum()) == 3.0 * 1024
    del value
    consumer.close()
    assert _gone(segment), f"{segment} was left once its last consumer had left"


# ------------------------------------------------------------------------------------
# 12. A container's main process SIGKILLed: what is left, and how a deployment removes it.

SERVER = textwrap.dedent(
    """
    import os, sys, time
    from shmq import MessageQueue
    mq = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    print(mq.buffer.name, os.getpid(), flush=True)
    time.sleep(600)
    """
)


def _container(init: bool) -> tuple[subprocess.Popen, str, int]:
    """A serving process in a pid namespace of its own (a container sharing /dev/shm with
    the host, as ``--ipc=host`` does): pid 1 there, or pid 2 under tini (``docker run
    --init``). Returns the namespace's process here, its ring's name and the server's
    pid inside."""
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a pid namespace needs root and unshare")
    command = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
    if init:
        tini = shutil.which("tini")
        assert tini, "tini is installed by scripts/envs.sh"
        command += [tini, "--"]
    proc = subprocess.Popen([*command, sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    if len(line) != 2:
        proc.kill()
        proc.wait(timeout=30)
        pytest.skip(f"cannot run a process in a pid namespace here: {line}")
    return proc, line[0], int(line[1])


@pytest.mark.parametrize("init", [False, True], ids=["server-is-pid-1", "under-tini"])
def test_a_containers_main_process_sigkilled_leaves_what_cleanup_then_removes(init):
    """Issue 54 item 12: when pid 1 of a pid namespace dies the kernel kills every process
    in it, the janitor included, so a SIGKILLed server leaves its segments where
    ``/dev/shm`` is shared. ``--init`` does not change that: tini exits with its one child
    and the namespace goes with it. What a deployment does instead (docs/operations.md):
    ``python -m shmq cleanup`` as the next start's first step, or on the host. It proves
    the dead server's segments dead by their locks (its pid means nothing here) and
    removes them, and keeps a live process's."""
    live = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1024, max_chunks=2)
    proc, ring, pid_inside = _container(init)
    assert pid_inside == (2 if init else 1)
    server = next(int(p) for p in os.listdir("/proc") if p.isdigit() and _runs_server(int(p), proc.pid))
    os.kill(server, 9)
    proc.wait(timeout=30)
    time.sleep(0.5)  # not synchronisation: time for a janitor, had one survived, to act
    assert (SHM / ring).exists(), "the janitor outlived the namespace: update docs/operations.md"
    out = subprocess.run([sys.executable, "-m", "shmq", "cleanup"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"removed {ring}" in out.stdout, out.stdout
    assert not (SHM / ring).exists() and not (SHM / f"{ring}.sock").exists()
    assert (SHM / live.buffer.name).exists(), "cleanup removed a live process's queue"
    live.shutdown()


def _runs_server(pid: int, namespace_root: int) -> bool:
    """Whether process ``pid`` (seen from here) is the server started under
    ``namespace_root`` (``unshare``'s process): the test's server, a descendant of it."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"MessageQueue(n_reader=1" not in f.read():
                return False
        while pid > 1:
            with open(f"/proc/{pid}/status") as f:
                pid = int(next(line for line in f if line.startswith("PPid:")).split()[1])
            if pid == namespace_root:
                return True
    except (OSError, StopIteration, ValueError):
        return False
    return False
