"""Segments under a name the caller chose (vLLM names its multimodal store
``vllm_mm_<id>``): removed by their creator's janitor after a SIGKILL like shmq's own, only
the very file the creator made (never a successor's under the same name, never through a
symlink), listed and removed by ``cleanup`` when nothing else removed them, and taken over
by a new writer once the old one is proved dead. All in real processes (issues 42, 44).
"""

from __future__ import annotations

import os
import re
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
time.sleep(600)
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
