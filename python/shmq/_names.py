"""Queues and stores by name: ``MessageQueue.open(name, rank)`` and
``ObjectStorage.open(name)``, for processes of the same user on this machine.

A writer made with a name (``MessageQueue(..., name=...)``, an ``ObjectStorage`` on a
``RingBuffer(create=True, name=...)``) records its handle under that name: one file per
name in a directory of this user's own (mode 0700, each record 0600: a queue's handle
holds the secret of its remote stream). The record's file is named by a hash of the
name (``q.<sha256>`` for a queue, ``s.<sha256>`` for a store), so that every name a
segment may have (1 to 200 bytes of text) fits in a file name; the name itself is kept in
the record and checked on every lookup. Names are scoped to the user: another user's
queue of the same name is another queue, out of reach.

**Who holds a name: a lock, not a pid.** The writer holds an open-file-description lock
(``F_OFD_SETLK``) on byte 0 of its record's file for as long as it holds the name, taken
before the record is published (the file is made unnamed, locked and filled, then linked
under its name). The kernel drops the lock when the writer closes its last descriptor of
the file, which is also when it dies, however it dies (a forked child's copy of the
descriptor is closed in the child at once). Every process that can open the file sees
the lock (``F_OFD_GETLK``), whatever its pid namespace: a writer in another container
that shares ``/dev/shm`` is seen alive, as the queues' own role locks see their peers
(``crates/os/src/liveness.rs``). A record is therefore **alive** (its lock is held),
**dead** (it is not: proved, its writer released it or is gone; a record whose lock
nobody ever held, such as a damaged file, is dead too), or **unknown** (the lock cannot
be tested). Only a dead record is removed or taken over; an unknown one is never touched
and its name is refused to a new writer. Pids in records are for messages only.

**Removing a dead record is race-free.** Whoever removes one (an open of its name, a new
writer of its name, or any new writer's sweep) takes a second lock, on byte 1 of that
same file, checks that the name still leads to that file, and unlinks it; the name then
goes to whichever writer's link lands first (``link`` fails on a name that exists), and
every other writer finds that one's lock held. Nobody replaces a record in place, so a
reader never sees half of one.

**The directory.** ``/dev/shm/.shmq-names-<uid>``, made by the first named writer. Where
that entry is not this user's directory (another user made it first, or put a symlink
there: anyone may create entries in ``/dev/shm``, and only their owner may remove them),
the user's names live in the first of ``.shmq-names-<uid>.1``, ``.2``, ... that is (made
if none is): every process of the user, in any container sharing ``/dev/shm``, finds the
same one by the same rule (the directory of the user with the lowest number), and a
warning names the squatted entry. So a stranger cannot deny a user's names by squatting,
only push them to another directory. One race is left: a stranger who removes its squat
while the user's processes make their first directory can have two of them made (from
then on all use the lower one; a writer already recorded in the other is not found by
name until it ends). ``SHMQ_NAMES_DIR`` names a directory of the user's choice
instead (made 0700 if missing; it must be a directory of this user that no one else may
enter): set it alike in every process that shares names. A directory of the user's own
that others may enter is refused (``PermissionError``): it could show this user
another's queues.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
import struct
import time
import uuid
import weakref
from typing import Any, Optional

from . import _core

#: Names a directory to keep this user's names in instead of ``/dev/shm/.shmq-names-<uid>``.
DIRECTORY_ENV = "SHMQ_NAMES_DIR"

_KINDS = {"queue": "q.", "store": "s."}

ALIVE, DEAD, UNKNOWN = "alive", "dead", "unknown"
# Byte 0 of a record's file: held by its writer for as long as it holds the name.
_WRITER_BYTE = 0
# Byte 1: held by a process while it removes the (dead) record.
_REMOVER_BYTE = 1
# struct flock on 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid (and padding).
_FLOCK = "hhqqi4x"
# How many times a new writer tries to take a name whose record it found dead (another
# remover or writer may be at it at the same moment), 1 ms apart after the first few.
_ATTEMPTS = 200
# How far past ``.shmq-names-<uid>`` a user's directory is looked for, when strangers
# squat that many entries.
_MAX_FALLBACK = 1000

log = logging.getLogger("shmq.names")
_warned: set[tuple[str, str]] = set()


# -- the directory ---------------------------------------------------------------------


def _ours(path: str) -> Optional[bool]:
    """Whether ``path`` is a directory of this user (not a symlink to one); None if there
    is nothing there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def _checked(path: str, how: str) -> str:
    """``path``, a directory of this user's; ``PermissionError`` if it is not one that only
    this user can enter (it could show this user another's queues)."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"{path} ({how}) is not a directory of queue and store names that only this user may "
            f"enter (owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}; this is uid {os.getuid()}): "
            "opening by name is refused until it is; handles still work"
        )
    return path


def _fallbacks(base: str) -> list[int]:
    """The numbers ``n`` of the entries ``<base>.<n>`` in its directory, in order."""
    parent, prefix = os.path.dirname(base), os.path.basename(base) + "."
    try:
        entries = os.listdir(parent)
    except OSError:
        return []
    numbers = []
    for entry in entries:
        suffix = entry[len(prefix) :]
        if entry.startswith(prefix) and suffix.isdigit() and suffix.isascii() and str(int(suffix)) == suffix:
            numbers.append(int(suffix))
    return sorted(numbers)


def _noted(path: str, base: str) -> str:
    """``path`` (a fallback directory), after a warning, once per process, that ``base`` is
    not this user's."""
    if (base, path) not in _warned:
        _warned.add((base, path))
        try:
            st = os.lstat(base)
            what = f"{'a symlink' if stat.S_ISLNK(st.st_mode) else 'an entry'} of uid {st.st_uid}"
        except OSError:
            what = "gone now"
        log.warning(
            "%s is not this user's directory of queue and store names (%s; this is uid %d): this "
            "user's names are in %s, which every process of this user sharing %s finds the same way; "
            "set %s to choose the directory",
            base,
            what,
            os.getuid(),
            path,
            os.path.dirname(base),
            DIRECTORY_ENV,
        )
    return path


def directory(create: bool = False) -> Optional[str]:
    """This user's directory of names (see the module docs); None when there is none yet
    and ``create`` is false. ``PermissionError`` when the one found may be entered by
    others, or when ``SHMQ_NAMES_DIR`` names no directory of this user's."""
    chosen = os.environ.get(DIRECTORY_ENV)
    if chosen:
        how = f"named by {DIRECTORY_ENV}"
        if create:
            try:
                os.mkdir(chosen, 0o700)
            except FileExistsError:
                pass
        try:
            return _checked(chosen, how)
        except FileNotFoundError:
            return None
    base = f"{_core.SHM_DIR}/.shmq-names-{os.getuid()}"
    how = "this user's directory of names"
    if _ours(base):
        return _checked(base, how)
    # Absent, or not this user's: this user's names are in the directory of this user with
    # the lowest number, if there is one. (None is made below it while one exists, so
    # every process of the user picks the same one.)
    for n in _fallbacks(base):
        if _ours(f"{base}.{n}"):
            return _noted(_checked(f"{base}.{n}", how), base)
    if not create:
        return None
    for n in range(_MAX_FALLBACK + 1):
        path = base if n == 0 else f"{base}.{n}"
        if _ours(path) is None:
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass  # another process made it at the same moment: whose is it?
        if _ours(path):
            return _checked(path, how) if n == 0 else _noted(_checked(path, how), base)
    raise PermissionError(
        f"{base} and {base}.1 to .{_MAX_FALLBACK} are all taken by other users: opening by name is "
        f"refused; set {DIRECTORY_ENV} to a directory of this user's (handles still work)"
    )


def _check_name(kind: str, name: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if not name or len(name.encode()) > 200 or any(ord(c) < 32 for c in name):
        raise ValueError(f"{name!r} is no {kind} name: 1 to 200 bytes of text with no control characters")


def _file_name(kind: str, name: str) -> str:
    return _KINDS[kind] + hashlib.sha256(name.encode()).hexdigest()


def _is_record_name(entry: str) -> bool:
    return len(entry) == 66 and entry[:2] in _KINDS.values() and all(c in "0123456789abcdef" for c in entry[2:])


def _record_path(kind: str, name: str, create: bool) -> Optional[str]:
    """Where the record of ``name`` is (or would be); None when this user has no directory
    of names yet and ``create`` is false."""
    _check_name(kind, name)
    d = directory(create)
    return None if d is None else f"{d}/{_file_name(kind, name)}"


# -- locks ------------------------------------------------------------------------------


def _flock(kind: int, byte: int) -> bytes:
    return struct.pack(_FLOCK, kind, os.SEEK_SET, byte, 1, 0)


def _try_lock(fd: int, byte: int) -> bool:
    """Take this open file description's write lock on byte ``byte``; False if another
    holds a lock on it."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, byte))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _liveness(fd: int) -> str:
    """Whether the writer of the record open as ``fd`` holds it: ``ALIVE``, ``DEAD``
    (proved: nobody holds its lock) or ``UNKNOWN`` (the lock cannot be tested)."""
    try:
        got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, _WRITER_BYTE))
    except OSError:
        return UNKNOWN
    return DEAD if struct.unpack(_FLOCK, got)[0] == fcntl.F_UNLCK else ALIVE


# -- records ----------------------------------------------------------------------------


def _parse(data: bytes, kind: str, name: str) -> Optional[dict[str, Any]]:
    """The record in ``data`` if it is a whole record of the ``kind`` named ``name``;
    None otherwise (never an error of another type: the file is only as good as whoever
    wrote it)."""
    try:
        record = json.loads(data)
    except ValueError:
        return None
    if (
        not isinstance(record, dict)
        or record.get("kind") != kind
        or record.get("name") != name
        or type(record.get("pid")) is not int
    ):
        return None
    return record


def _examine(path: str, kind: str, name: str) -> Optional[tuple[str, Optional[dict[str, Any]], os.stat_result]]:
    """``(liveness, record or None if damaged, the file's stat)`` of the record at
    ``path``; None if there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return UNKNOWN, None, st
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        # A record is written in full before it is linked under its name and never
        # changed after, so what was read is what its writer wrote.
        return _liveness(fd), _parse(b"".join(chunks), kind, name), st
    finally:
        os.close(fd)  # this descriptor holds no lock: closing it releases nobody's


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _remove_dead(path: str, seen: os.stat_result) -> None:
    """Remove the record at ``path`` if it is still the file ``seen`` and still dead.

    Safe against every other process doing the same, and against new writers: the
    remover holds the file's byte-1 lock, so no other remover unlinks it meanwhile; its
    writer is gone, so it does not either; and a name that exists cannot be linked over.
    So the name still leads to this file when it is unlinked, never to a new writer's."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return  # gone already (or not a file we may open: then not ours to remove)
    try:
        if not _same(os.fstat(fd), seen) or not _try_lock(fd, _REMOVER_BYTE) or _liveness(fd) != DEAD:
            return  # another record by now, another remover at it, or not dead
        try:
            still = _same(os.lstat(path), seen)
        except FileNotFoundError:
            return
        if still:
            os.unlink(path)
    except OSError:
        pass
    finally:
        os.close(fd)  # releases the byte-1 lock


def _sweep(d: str) -> None:
    """Remove the records of writers that died (SIGKILL leaves them): every claim does,
    so that they do not pile up in ``/dev/shm``. Only dead ones: a live writer in another
    pid namespace holds its lock as any other does."""
    try:
        entries = os.listdir(d)
    except OSError:
        return
    for entry in entries:
        if not _is_record_name(entry):
            continue  # a new record not yet published, or another version's file
        path = f"{d}/{entry}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st, state = os.fstat(fd), _liveness(fd)
        finally:
            os.close(fd)
        if state == DEAD and stat.S_ISREG(st.st_mode):
            _remove_dead(path, st)


class _Claim:
    """A name held: the descriptor that holds its record's lock. ``release()`` removes the
    record and lets the lock go; a forked child's copy holds nothing (its descriptor is
    closed in the child at once, so that the child cannot keep a dead writer's name)."""

    def __init__(self, fd: int, path: str) -> None:
        st = os.fstat(fd)
        self.fd, self.path, self.pid, self.identity = fd, path, os.getpid(), (st.st_dev, st.st_ino)
        _claims.add(self)

    def release(self) -> None:
        """Remove the record (if it is still this one) and drop the lock. Idempotent; a
        no-op in a forked child."""
        fd, self.fd = self.fd, -1
        if fd < 0 or os.getpid() != self.pid:
            return
        try:
            st = os.lstat(self.path)
            # Nobody else removes a record whose lock is held: this is still ours.
            if (st.st_dev, st.st_ino) == self.identity:
                os.unlink(self.path)
        except OSError:
            pass  # gone already
        finally:
            os.close(fd)

    def _forget_in_child(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1


_claims: "weakref.WeakSet[_Claim]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for held in list(_claims):
        held._forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _new_record(d: str, data: bytes) -> tuple[int, Optional[str]]:
    """A record's file with ``data`` in it, its writer lock already held, not yet under
    any name a lookup reads: ``(descriptor, None)`` for an unnamed file (``O_TMPFILE``),
    ``(descriptor, temporary path)`` where the file system has none."""
    try:
        if not os.path.isdir("/proc/self/fd"):
            raise OSError(errno.ENOENT, "no /proc/self/fd to link an unnamed file through")
        fd, tmp = os.open(d, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600), None
    except OSError:
        tmp = f"{d}/.new.{uuid.uuid4().hex}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if not _try_lock(fd, _WRITER_BYTE):
            raise OSError(errno.EAGAIN, "a new record's lock is held by another process")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        if tmp is not None:
            os.unlink(tmp)
        raise
    return fd, tmp


def _publish(fd: int, tmp: Optional[str], path: str) -> bool:
    """Link the new record under ``path``; False if a record is there already."""
    if tmp is not None:
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    # An unnamed file is linked through its /proc entry, which linkat must follow
    # (AT_SYMLINK_FOLLOW: os.link passes it only along with a directory descriptor).
    parent = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(f"/proc/self/fd/{fd}", os.path.basename(path), dst_dir_fd=parent, follow_symlinks=True)
    except FileExistsError:
        return False
    finally:
        os.close(parent)
    return True


def claim(kind: str, name: str, details: dict[str, Any]) -> _Claim:
    """Record ``details`` under ``name`` for this process; the name is held until the
    returned claim's ``release()`` (or this process's end). ``FileExistsError`` when a
    live writer holds the name, or one whose liveness cannot be told."""
    _check_name(kind, name)
    d = directory(create=True)
    assert d is not None, "made if missing"
    path = f"{d}/{_file_name(kind, name)}"
    _sweep(d)
    record = {"kind": kind, "name": name, "pid": os.getpid()}
    record.update(details)
    fd, tmp = _new_record(d, json.dumps(record).encode())
    try:
        for attempt in range(_ATTEMPTS):
            if _publish(fd, tmp, path):
                return _Claim(fd, path)
            found = _examine(path, kind, name)
            if found is None:
                continue  # removed meanwhile: try again
            state, held, st = found
            if state == ALIVE:
                by = f"made by pid {held['pid']}, which holds it still" if held is not None else "its writer holds it"
                raise FileExistsError(
                    f"a {kind} named {name!r} already exists ({by}): names are unique per user on this machine"
                )
            if state == UNKNOWN:
                raise FileExistsError(
                    f"a {kind} named {name!r} is recorded in {path}, and whether its writer is alive "
                    "cannot be told: the name is not taken over"
                )
            # Dead (its writer ended or died, or it is damaged): removed, then taken if no
            # other writer links its own first.
            _remove_dead(path, st)
            if attempt >= 10:
                time.sleep(0.001)  # another process is removing it: let it finish
        raise FileExistsError(f"a {kind} named {name!r} is being taken by other processes at this moment")
    except BaseException:
        os.close(fd)
        raise
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass


def lookup(kind: str, name: str) -> dict[str, Any]:
    """The record of the live writer of the ``kind`` named ``name``; ``FileNotFoundError``
    naming it when there is none (never made, ended, or its writer died: proved by its
    lock, then its record is removed), ``PermissionError`` when this user's directory of
    names may be entered by others. A record whose writer's liveness cannot be told is
    returned as it is (the handle in it says whether the writer is there)."""
    how = "MessageQueue(..., name=...)" if kind == "queue" else "an ObjectStorage on RingBuffer(create=True, name=...)"
    missing = FileNotFoundError(
        f"no {kind} named {name!r} on this machine for this user (uid {os.getuid()}): names are "
        f"scoped to the user; was it made with {how}, and is its writer still running?"
    )
    path = _record_path(kind, name, create=False)
    found = _examine(path, kind, name) if path is not None else None
    if path is None or found is None:
        raise missing
    state, record, st = found
    if state == DEAD:
        _remove_dead(path, st)
        if record is not None:
            raise FileNotFoundError(
                f"the {kind} named {name!r} is gone: its writer (pid {record['pid']}) is no longer running"
            )
    if record is None:
        raise missing
    return record
