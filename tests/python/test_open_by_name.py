"""Opening a queue or a store by name (issue 45 item 5, issue 54 items 2, 9, 10), in real
processes: a writer in one process, readers that know only its name in another; a
missing name, a name already held, a writer that died, another user; a live writer in
another pid namespace, writers racing for a dead record, names as long as segment names,
a stranger squatting the user's directory of names, ``SHMQ_NAMES_DIR``."""

from __future__ import annotations

import os
import random
import re
import select
import shutil
import stat
import subprocess
import sys
import uuid

import pytest

from _processes import namespace_writer
from _processes.harness import CTX, STEP, segment_creator_pid, shm_segments, wait_for, wait_until_gone
from _processes.named_children import (
    as_user,
    claim_racer,
    named_reader,
    named_store,
    named_writer,
    named_writer_that_forks,
    open_as_another_user,
    squat_names,
)
from shmq import MessageQueue, ObjectStorage, QueueShutDownError, _names


def _name(what: str) -> str:
    return f"{what} {os.getpid()}-{uuid.uuid4().hex[:8]}"


def _gone(name: str, pid: int) -> str:
    """What opening ``name`` says once its writer ``pid`` was killed: its record names the
    dead writer, or, where another process's claim of a name swept the dead record first
    (any test running beside this one), there is no such name any more."""
    quoted = re.escape(repr(name))
    return f"(the queue named {quoted} is gone: its writer \\(pid {pid}\\)|no queue named {quoted})"


def test_a_reader_opens_a_queue_of_another_process_by_its_name(children) -> None:
    name = _name("results →")
    out = children.queue()
    children.start(named_writer, out, name, None, [{"n": i} for i in range(5)], None, "shutdown")
    children.expect(out, "ready")
    mq = MessageQueue.open(name, 0)
    mq.wait_until_ready(timeout=STEP)
    assert mq.name == name
    assert [mq.dequeue(timeout=STEP) for _ in range(5)] == [{"n": i} for i in range(5)]
    with pytest.raises(QueueShutDownError):
        mq.dequeue(timeout=STEP)
    children.join()
    # Shut down: the name is free, and opening it says there is no such queue.
    with pytest.raises(FileNotFoundError, match=f"no queue named {name!r}"):
        MessageQueue.open(name, 0)


def test_a_missing_name_and_a_name_held_by_a_live_writer_are_clear_errors() -> None:
    name = _name("missing")
    with pytest.raises(FileNotFoundError, match=f"no queue named {name!r} on this machine for this user"):
        MessageQueue.open(name, 0)
    with pytest.raises(FileNotFoundError, match=f"no store named {name!r}"):
        ObjectStorage.open(name)
    held = MessageQueue(1, 1, name=name)
    try:
        with pytest.raises(FileExistsError, match=f"a queue named {name!r} already exists .*pid {os.getpid()}"):
            MessageQueue(1, 1, name=name)
    finally:
        held.shutdown()
    # Free again once its writer shut down.
    again = MessageQueue(1, 1, name=name)
    again.shutdown()


def test_a_killed_writer_leaves_no_name_behind(children) -> None:
    name = _name("killed")
    out, go = children.queue(), children.event()
    p = children.start(named_writer, out, name, go, [], None, "kill")
    children.expect(out, "ready")
    mq = MessageQueue.open(name, 0)
    mq.wait_until_ready(timeout=STEP)
    go.set()
    wait_for(lambda: not p.is_alive(), what="the writer to be killed")
    with pytest.raises(FileNotFoundError, match=_gone(name, p.pid)):
        MessageQueue.open(name, 0)
    # The name is taken over by a new writer (no stale record in the way).
    new = MessageQueue(1, 1, name=name)
    try:
        assert MessageQueue.open(name, 0).name == name
    finally:
        new.shutdown()


def test_a_reader_opens_a_store_of_another_process_by_its_segment_name(children) -> None:
    name = f"shmqtest_store_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    out, end = children.queue(), children.event()
    children.start(named_store, out, name, end)
    _, address, signature = children.expect(out, "ready")
    store = ObjectStorage.open(name)
    assert store.n_readers == 1 and store.max_object_size == 1 << 16
    assert store.get(*address, signature=signature, key="image-1") == {"pixels": list(range(8))}
    store.close()
    end.set()
    children.expect(out, "closed")
    children.join()
    with pytest.raises(FileNotFoundError, match=f"no store named {name!r}"):
        ObjectStorage.open(name)


@pytest.mark.skipif(os.getuid() != 0, reason="acting as another user needs root")
def test_another_user_finds_neither_the_queue_nor_the_store(children) -> None:
    queue_name = _name("private")
    store_name = f"shmqtest_private_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    out, end = children.queue(), children.event()
    children.start(named_store, out, store_name, end)
    children.expect(out, "ready")
    mq = MessageQueue(1, 1, name=queue_name)
    try:
        children.start(open_as_another_user, out, 54321, queue_name, store_name)
        _, found = children.expect(out, "tried")
        (queue_error, queue_message), (store_error, store_message) = found
        assert queue_error == "FileNotFoundError" and f"no queue named {queue_name!r}" in queue_message
        assert "uid 54321" in queue_message
        assert store_error == "PermissionError", store_message
        assert f"segment {store_name!r} belongs to another user (uid 0" in store_message
    finally:
        mq.shutdown()
        end.set()
    children.expect(out, "closed")


def test_a_damaged_record_is_no_queue_and_its_name_can_be_taken() -> None:
    name = _name("damaged")
    mq = MessageQueue(1, 1, name=name)
    record = _names._record_path("queue", name, create=False)
    mq.shutdown()
    for garbage in ("not json", '{"pid": "x"}', "[1, 2]"):
        with open(record, "w") as f:
            f.write(garbage)
        with pytest.raises(FileNotFoundError, match=f"no queue named {name!r}"):
            MessageQueue.open(name, 0)
        taken = MessageQueue(1, 1, name=name)
        try:
            assert MessageQueue.open(name, 0).name == name
        finally:
            taken.shutdown()


def test_a_killed_writers_record_is_removed_by_the_next_named_writer(children) -> None:
    name = _name("swept")
    out, go = children.queue(), children.event()
    p = children.start(named_writer, out, name, go, [], None, "kill")
    children.expect(out, "ready")
    record = _names._record_path("queue", name, create=False)
    assert os.path.exists(record)
    mq = MessageQueue.open(name, 0)
    mq.wait_until_ready(timeout=STEP)
    go.set()
    wait_for(lambda: not p.is_alive(), what="the writer to be killed")
    other = MessageQueue(1, 1, name=_name("another"))  # any claim sweeps the dead writers' records
    try:
        assert not os.path.exists(record)
        with pytest.raises(FileNotFoundError, match=f"no queue named {name!r}"):
            MessageQueue.open(name, 0)
    finally:
        other.shutdown()


# -- issue 54 item 9: liveness by lock, not by pid -------------------------------------


def _unshare_works() -> bool:
    try:
        done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=STEP)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _line(p: subprocess.Popen) -> str:
    """The next line the program ``p`` prints, within ``STEP`` seconds."""
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], STEP)
    assert ready, f"no line from the program within {STEP} s"
    line = p.stdout.readline()
    assert line, f"the program ended early:\n{p.communicate(timeout=STEP)[1][-3000:]}"
    return line


@pytest.mark.skipif(not _unshare_works(), reason="needs `unshare --pid --fork --mount-proc` (root)")
def test_a_live_writer_in_another_pid_namespace_keeps_its_name() -> None:
    # As two containers sharing /dev/shm: the writer's pid means nothing here (it is 1 in
    # its namespace, and /proc/1 here is someone else), but its lock is seen.
    name = _name("namespaced")
    before = shm_segments()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    program = ["unshare", "--pid", "--kill-child", "--mount-proc", sys.executable, namespace_writer.__file__, name]
    p = subprocess.Popen(
        program, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    pid_there = "0"
    try:
        tag, pid_there = _line(p).split()
        assert tag == "ready"
        record = _names._record_path("queue", name, create=False)
        assert record is not None and os.path.exists(record)
        mq = MessageQueue.open(name, 0)
        mq.wait_until_ready(timeout=STEP)
        assert mq.dequeue(timeout=STEP) == namespace_writer.MESSAGE
        with pytest.raises(FileExistsError, match=f"a queue named {name!r} already exists"):
            MessageQueue(1, 1, name=name)
        other = MessageQueue(1, 1, name=_name("another"))  # a claim sweeps dead records: not this one
        other.shutdown()
        assert os.path.exists(record)
        assert _names.lookup("queue", name)["pid"] == int(pid_there)
        assert p.stdin is not None
        p.stdin.write("end\n")
        p.stdin.flush()
        assert _line(p).strip() == "ended"
        assert p.wait(timeout=STEP) == 0
        mq.shutdown()
        del mq
    finally:
        if p.poll() is None:
            p.kill()  # and its child, the writer (--kill-child)
            p.wait(STEP)
            # Its janitor ended with its pid namespace: remove what it left.
            for left in {n for n in shm_segments() - before if segment_creator_pid(n) == int(pid_there)}:
                path = f"/dev/shm/{left}"
                shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
    with pytest.raises(FileNotFoundError, match=f"no queue named {name!r}"):
        MessageQueue.open(name, 0)
    wait_until_gone(
        lambda: {n for n in shm_segments() - before if segment_creator_pid(n) == int(pid_there)},
        "the segments of the writer in the other pid namespace",
    )


def test_writers_racing_for_a_damaged_record_never_both_get_its_name(children) -> None:
    rounds, racers = 1000, 3
    base = _name("raced")
    out, barrier = children.queue(), CTX.Barrier(racers + 1)
    for _ in range(racers):
        children.start(claim_racer, out, base, rounds, barrier)
    wrong = []
    for r in range(rounds):
        record = _names._record_path("queue", f"{base} {r}", create=True)
        assert record is not None
        with open(record, "w") as f:
            f.write("not a record")
        barrier.wait(STEP)
        winners = [pid for _, _, pid, got in (children.expect(out, "tried") for _ in range(racers)) if got]
        if len(winners) != 1:
            wrong.append((r, winners))
        try:
            os.unlink(record)  # the winner's (it holds its name until it ends)
        except FileNotFoundError:
            pass
    children.join()
    assert not wrong, f"rounds where not exactly one writer got the name (round, winners): {wrong}"


def test_a_forked_child_does_not_keep_a_killed_writers_name(children) -> None:
    name = _name("forked")
    out, go = children.queue(), children.event()
    p = children.start(named_writer_that_forks, out, name, go)
    _, pid, forked = children.expect(out, "ready")
    try:
        go.set()
        wait_for(lambda: not p.is_alive(), what="the writer to be killed")
        assert os.path.exists(f"/proc/{forked}"), "its forked child still runs"
        with pytest.raises(FileNotFoundError, match=_gone(name, pid)):
            MessageQueue.open(name, 0)
    finally:
        try:
            os.kill(forked, 9)
        except ProcessLookupError:
            pass


# -- issue 54 item 10: every segment name is a store name ------------------------------


@pytest.mark.parametrize("name", ["%" * 85, "\u00e9" * 100], ids=["85 percent signs", "100 two-byte characters"])
def test_a_store_named_by_any_segment_name_opens_by_it(children, name) -> None:
    with pytest.raises(FileNotFoundError, match="no store named"):
        ObjectStorage.open(name)
    out, end = children.queue(), children.event()
    children.start(named_store, out, name, end)
    _, address, signature = children.expect(out, "ready")
    store = ObjectStorage.open(name)
    assert store.get(*address, signature=signature, key="image-1") == {"pixels": list(range(8))}
    store.close()
    end.set()
    children.expect(out, "closed")
    children.join()
    with pytest.raises(FileNotFoundError, match="no store named"):
        ObjectStorage.open(name)


# -- issue 54 item 2: a stranger cannot deny a user's names ----------------------------


def _remove_names_of(uid: int) -> None:
    """Remove every entry of user ``uid``'s directory of names, and strangers' squats."""
    prefix = f".shmq-names-{uid}"
    for entry in os.listdir("/dev/shm"):
        if entry == prefix or entry.startswith(prefix + "."):
            path = f"/dev/shm/{entry}"
            if stat.S_ISDIR(os.lstat(path).st_mode):
                shutil.rmtree(path)
            else:
                os.unlink(path)


@pytest.mark.skipif(os.getuid() != 0, reason="playing two other users needs root")
@pytest.mark.parametrize("how", ["directory", "symlink", "several"])
def test_a_stranger_squatting_the_names_directory_denies_no_name(children, how) -> None:
    stranger, victim = 65534, random.randrange(30000, 60000)
    name = _name("squatted")
    out, end = children.queue(), children.event()
    try:
        children.start(as_user, out, stranger, squat_names, victim, how)
        children.expect(out, "squatted")
        # Two processes of the user find each other all the same.
        children.start(as_user, out, victim, named_writer, name, None, ["hello"], end, "shutdown")
        children.expect(out, "ready")
        children.start(as_user, out, victim, named_reader, name, 1)
        assert children.expect(out, "read")[1] == ["hello"]
        end.set()
        children.expect(out, "sent")
        children.join()
        fallback = f"/dev/shm/.shmq-names-{victim}.{3 if how == 'several' else 1}"
        st = os.lstat(fallback)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == victim and stat.S_IMODE(st.st_mode) == 0o700
    finally:
        _remove_names_of(victim)


def test_shmq_names_dir_names_the_directory_of_names(children, monkeypatch) -> None:
    directory = f"/dev/shm/.shmqtest-names-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("SHMQ_NAMES_DIR", directory)
    name = _name("elsewhere")
    out, end = children.queue(), children.event()
    try:
        children.start(named_writer, out, name, None, ["hi"], end, "shutdown")  # inherits the variable
        children.expect(out, "ready")
        record = _names._record_path("queue", name, create=False)
        assert record is not None and os.path.dirname(record) == directory and os.path.exists(record)
        mq = MessageQueue.open(name, 0)
        mq.wait_until_ready(timeout=STEP)
        assert mq.dequeue(timeout=STEP) == "hi"
        # A directory others may enter is refused, loudly.
        os.chmod(directory, 0o755)
        with pytest.raises(PermissionError, match="named by SHMQ_NAMES_DIR"):
            MessageQueue.open(name, 0)
        os.chmod(directory, 0o700)
        end.set()
        children.expect(out, "sent")
        children.join()
        mq.shutdown()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
