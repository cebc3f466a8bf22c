"""Segments under a name the caller chose (vLLM names its multimodal store
``vllm_mm_<id>``): removed by their creator's janitor after a SIGKILL like shmq's own, only
the very file the creator made (never a successor's under the same name, never through a
symlink), listed and removed by ``cleanup`` when nothing else removed them, and taken over
by a new writer once the old one is proved dead; and the janitor itself: no name lost to
a stall, not held by a child forked at C level. All in real processes (issues 42, 44).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import uuid

import pytest

from _processes.harness import STEP, wait_for
from shmq import ObjectStorage, RingBuffer

SHM = "/dev/shm"

# A child that makes a named store (vLLM's way: RingBuffer(create=True, name=...), then
# the object store over it), says so, and waits to be killed.
CREATOR = """
import sys, time
from shmq import ObjectStorage, RingBuffer
from shmq.serde import MsgpackSerde
ring = RingBuffer(1 << 20, name=sys.argv[1], create=True)
store = ObjectStorage(max_object_size=1 << 16, n_readers=1, ring_buffer=ring, serde_class=MsgpackSerde)
store.put("k", b"x" * 100)
# A second store, made after the first: its janitor removes names in the order they were
# made, so once this one is gone the janitor has dealt with the first.
sentinel = RingBuffer(1 << 16, name=sys.argv[1] + "-sentinel", create=True)
print("ready", flush=True)
time.sleep(600)  # not synchronisation: alive until the test kills it
"""


def _name(prefix: str) -> str:
    return f"{prefix}{os.getpid()}_{uuid.uuid4().hex[:10]}"


def _start(name: str, janitor: bool = True) -> subprocess.Popen:
    env = dict(os.environ)
    if janitor:
        env.pop("SHMQ_NO_JANITOR", None)
    else:
        env["SHMQ_NO_JANITOR"] = "1"
    p = subprocess.Popen([sys.executable, "-c", CREATOR, name], stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == "ready", line
    return p


def _kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(STEP)


def _janitor_done(name: str) -> None:
    """Wait until the killed creator's janitor has dealt with ``name`` (it removed the
    sentinel made after it)."""
    sentinel = os.path.join(SHM, name + "-sentinel")
    wait_for(lambda: not os.path.exists(sentinel), STEP, "the janitor to remove the sentinel store")


def _cleanup(*args: str) -> set[str]:
    """The names ``python -m shmq cleanup`` removed (or, with --dry-run, would remove)."""
    out = subprocess.run([sys.executable, "-m", "shmq", "cleanup", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"^(?:would remove|removed) (\S+) \(", out.stdout, re.M))


@pytest.fixture
def named():
    """Names for this test; whatever is left under them is removed at the end."""
    names: list[str] = []

    def make(prefix: str = "vllm_mm_t") -> str:
        names.append(_name(prefix))
        return names[-1]

    yield make
    for n in names:
        for left in (n, n + "-sentinel"):
            try:
                os.unlink(os.path.join(SHM, left))
            except FileNotFoundError:
                pass


def test_a_killed_writers_named_store_goes_with_its_janitor(named):
    # Before: the janitor removed only `shmq_*` names, so vLLM's store stayed.
    name = named()
    creator = _start(name)
    assert os.path.exists(os.path.join(SHM, name))
    _kill(creator)
    wait_for(lambda: not os.path.exists(os.path.join(SHM, name)), STEP, "the janitor to remove vLLM's named store")


def test_cleanup_lists_and_removes_a_named_store_and_a_restart_takes_the_name(named):
    # No janitor: the name stays after SIGKILL; cleanup sees it (by its header), and a new
    # writer under the same name takes it over (its creator is proved dead).
    name = named()
    creator = _start(name, janitor=False)
    live = _cleanup("--dry-run")
    assert name not in live, "a live writer's store listed as removable"
    _kill(creator)
    assert os.path.exists(os.path.join(SHM, name))
    assert name in _cleanup("--dry-run")
    # A restart under the name while the dead writer's file is still there.
    ring = RingBuffer(1 << 20, name=name, create=True)
    try:
        store = ObjectStorage(max_object_size=1 << 16, n_readers=1, ring_buffer=ring)
        store.put("again", [1, 2, 3])
        assert name not in _cleanup("--dry-run"), "the new live writer's store listed as removable"
        store.close()
    finally:
        del ring
    # And cleanup removes a dead writer's named store.
    creator = _start(name, janitor=False)
    _kill(creator)
    assert name in _cleanup()
    assert not os.path.exists(os.path.join(SHM, name))


def test_a_live_writers_name_is_refused_to_a_second_writer(named):
    name = named()
    creator = _start(name)
    try:
        with pytest.raises(ValueError, match="already exists"):
            RingBuffer(1 << 20, name=name, create=True)
        assert os.path.exists(os.path.join(SHM, name))
    finally:
        _kill(creator)
        wait_for(lambda: not os.path.exists(os.path.join(SHM, name)), STEP, "the janitor")


@pytest.mark.parametrize("prefix", ["vllm_mm_t", "shmq_store_t"])
def test_the_janitor_never_removes_a_successors_file_of_the_same_name(named, prefix):
    # The creator's file goes (as a crash-recovering successor removes it), a successor
    # makes its own under the same name, then the first creator dies: its janitor must
    # leave the successor's live file. Before: it removed any listed `shmq_*` name.
    name = named(prefix)
    first = _start(name)
    os.unlink(os.path.join(SHM, name))
    ring = RingBuffer(1 << 20, name=name, create=True)
    try:
        _kill(first)
        _janitor_done(name)
        assert os.path.exists(os.path.join(SHM, name)), "the dead creator's janitor removed its successor's file"
        RingBuffer(1 << 20, name=name)  # still opens
    finally:
        del ring


def test_the_janitor_never_follows_a_symlink_in_its_owners_place(named, tmp_path):
    name = named("shmq_store_t")
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    first = _start(name)
    path = os.path.join(SHM, name)
    os.unlink(path)
    os.symlink(victim, path)
    try:
        _kill(first)
        _janitor_done(name)
        assert victim.read_text() == "keep me"
        assert os.path.islink(path), "the janitor removed a symlink that is not what its owner made"
    finally:
        os.unlink(path)


# --- The janitor itself: not lost to a stall, not held by a C-level fork (issue 44) -------

# A creator driven line by line on stdin: "burst N" makes and drops N stores (2N messages
# to the janitor), "keep N" makes N stores it keeps, "fork" forks at C level (glibc's
# fork(): pthread_atfork handlers run, Python's fork hooks do not) a child that sleeps.
DRIVEN = """
import ctypes, os, sys, time
from shmq import RingBuffer
kept = [RingBuffer(4096, create=True)]
print("pid", os.getpid(), flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "burst":
        for _ in range(int(arg)):
            RingBuffer(4096, create=True)
    elif cmd == "keep":
        kept += [RingBuffer(4096, create=True) for _ in range(int(arg))]
    elif cmd == "fork":
        child = ctypes.CDLL(None).fork()
        if child == 0:
            time.sleep(120)  # not synchronisation: alive until the test kills it
            os._exit(0)
        print("child", child, flush=True)
        continue
    print("done", cmd, flush=True)
"""


def _janitor_queue(owner: int) -> int | None:
    """Bytes queued in ``owner``'s janitor socket that the janitor has not read yet."""
    out = subprocess.run(["ss", "-xpn"], capture_output=True, text=True, timeout=STEP).stdout
    for line in out.splitlines():
        f = line.split()
        if f and f[0] == "u_seq" and f"pid={owner}," in line:
            return int(f[3])
    return None


def _janitor_pid(owner: int, alone: bool = False) -> int | None:
    """The pid of ``owner``'s janitor: the process at the other end of its janitor's
    socket pair (``ss`` shows both ends' inodes); with ``alone``, only once no other
    process holds that end too."""
    out = subprocess.run(["ss", "-xpn"], capture_output=True, text=True, timeout=STEP).stdout
    peer = None
    for line in out.splitlines():
        f = line.split()
        if f and f[0] == "u_seq" and f"pid={owner}," in line:
            peer = f[7]
    if peer is None:
        return None
    for line in out.splitlines():
        f = line.split()
        if f and f[0] == "u_seq" and f[5] == peer:
            holders = re.findall(r"pid=(\d+),", line)
            if not holders or (alone and len(holders) > 1):
                return None
            return int(holders[0])
    return None


class _Driven:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVEN], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.pid = int(self.read("pid"))
        from _processes import CHILD_PIDS

        CHILD_PIDS.add(self.pid)  # the leftover check counts its segments

    def read(self, tag: str) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        assert line and line[0] == tag, line
        return line[1]

    def ask(self, line: str, tag: str = "done") -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.read(tag)

    def segments(self) -> set[str]:
        from _processes import segments_of

        return segments_of({self.pid})


@pytest.mark.skipif(not shutil.which("ss"), reason="needs ss (iproute2) to find the janitor's pid")
def test_a_janitor_stalled_during_a_burst_loses_no_name():
    # The janitor stopped while its owner makes and drops a thousand stores (2000
    # messages: several times what its socket holds at Linux's default buffer size, a few
    # hundred), then keeps ten: before, those ten names were
    # dropped with the socket full and left after the owner's SIGKILL.
    owner = _Driven()
    janitor = _janitor_pid(owner.pid)
    assert janitor, "the owner's janitor was not found"
    os.kill(janitor, signal.SIGSTOP)
    try:
        owner.ask("burst 1000")
        owner.ask("keep 10")
    finally:
        os.kill(janitor, signal.SIGCONT)
    # Once the janitor has read what its socket held, the owner's next message takes
    # what was held back along with it.
    wait_for(lambda: _janitor_queue(owner.pid) == 0, STEP, "the janitor to read its socket")
    owner.ask("keep 1")
    wait_for(lambda: _janitor_queue(owner.pid) == 0, STEP, "the janitor to read the held-back names")
    assert len(owner.segments()) == 12
    owner.proc.kill()
    owner.proc.wait(STEP)
    wait_for(lambda: not owner.segments(), STEP, "the janitor to remove every kept store")


def test_a_child_forked_at_c_level_does_not_keep_its_parents_segments():
    # glibc's fork() without Python's fork hooks: the child inherits the janitor's socket.
    # Before, the janitor saw its owner's death only once that child had exited too.
    owner = _Driven()
    child = int(owner.ask("fork", "child"))
    try:
        assert owner.segments()
        owner.proc.kill()
        owner.proc.wait(STEP)
        wait_for(lambda: not owner.segments(), STEP, "the janitor to remove the killed owner's store")
        assert os.path.exists(f"/proc/{child}"), "the forked child is still alive"
    finally:
        os.kill(child, signal.SIGKILL)


SUBREAPER = """
import ctypes, os, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
from shmq import RingBuffer
ring = RingBuffer(4096, create=True)
print("pid", os.getpid(), flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(not shutil.which("ss"), reason="needs ss (iproute2) to find the janitor's pid")
def test_a_subreaper_owner_keeps_no_zombie_of_its_janitor():
    # A subreaper is given the orphans below it: the janitor's start left one of its
    # processes there unreaped (a zombie for the owner's life).
    owner = subprocess.Popen([sys.executable, "-c", SUBREAPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert owner.stdout is not None
        pid = int(owner.stdout.readline().split()[1])
        def settled() -> int | None:
            # The janitor alone holds its end, asleep (in recv), and the owner adopted it:
            # whatever started it (a shell, an interpreter that forked it) has exited.
            j = _janitor_pid(pid, alone=True)
            if j is None:
                return None
            with open(f"/proc/{j}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return j if fields[0] == "S" and int(fields[1]) == pid else None

        janitor = wait_for(settled, STEP, "the owner's janitor to settle")

        def zombies() -> list[int]:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                children = [int(c) for c in f.read().split()]
            out = []
            for c in children:
                try:
                    with open(f"/proc/{c}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                            out.append(c)
                except FileNotFoundError:
                    pass
            return out

        assert zombies() == [], f"zombies of the owner (its janitor is {janitor})"
    finally:
        owner.kill()
        owner.wait(STEP)


QUEUE_OWNER = """
import os, sys
from shmq import MessageQueue
q = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
print("pid", os.getpid(), flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(not shutil.which("ss"), reason="needs ss (iproute2) to find the janitor's pid")
def test_the_janitor_never_empties_a_directory_a_symlink_points_to(tmp_path):
    # A queue's socket directory (<ring>.sock) replaced by a symlink to another
    # directory while its owner lives: once the owner dies, its janitor must not delete
    # the files of that other directory (before: it listed the "socket directory"
    # through the symlink and unlinked every entry).
    victim = tmp_path / "elsewhere"
    victim.mkdir()
    (victim / "keep").write_text("keep me")
    owner = subprocess.Popen([sys.executable, "-c", QUEUE_OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    link = None
    try:
        assert owner.stdout is not None
        pid = int(owner.stdout.readline().split()[1])
        dirs = [n for n in os.listdir(SHM) if n.startswith(f"shmq_ring_{pid}_") and n.endswith(".sock")]
        assert dirs, os.listdir(SHM)
        link = os.path.join(SHM, dirs[0])
        janitor = wait_for(lambda: _janitor_pid(pid), STEP, "the owner's janitor")
        os.rename(link, link + "-moved")
        os.symlink(victim, link)
        owner.kill()
        owner.wait(STEP)
        # The janitor has done all it will once it has exited.
        wait_for(lambda: not os.path.exists(f"/proc/{janitor}") or _state(janitor) == "Z", STEP, "the janitor to end")
        assert (victim / "keep").read_text() == "keep me", "the janitor deleted files through a symlink"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(STEP)
        if link is not None:
            if os.path.islink(link):
                os.unlink(link)
            shutil.rmtree(link + "-moved", ignore_errors=True)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


@pytest.mark.skipif(not shutil.which("ss"), reason="needs ss (iproute2) to find the janitor's pid")
def test_a_killed_janitor_is_noticed_and_replaced_with_every_name():
    # The janitor SIGKILLed while its owner lives: the owner's next segment finds it gone
    # and starts a new one, which is sent every name still held; the owner's SIGKILL then
    # leaves nothing. Before: the names were lost with the first janitor.
    owner = _Driven()
    first = wait_for(lambda: _janitor_pid(owner.pid), STEP, "the owner's janitor")
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: _state(first) in ("gone", "Z"), STEP, "the janitor to die")
    owner.ask("keep 2")
    second = wait_for(lambda: _janitor_pid(owner.pid), STEP, "a new janitor")
    assert second != first
    assert len(owner.segments()) == 3
    owner.proc.kill()
    owner.proc.wait(STEP)
    wait_for(lambda: not owner.segments(), STEP, "the new janitor to remove every store")
