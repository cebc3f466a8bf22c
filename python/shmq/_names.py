"""Queues and stores by name: ``MessageQueue.open(name, rank)`` and
``ObjectStorage.open(name)``, for processes of the same user on this machine.

A writer made with a name (``MessageQueue(..., name=...)``, an ``ObjectStorage`` on a
``RingBuffer(create=True, name=...)``) records its handle under that name in a directory
of this user's own, ``/dev/shm/.shmq-names-<uid>`` (mode 0700, each record 0600: a
queue's handle holds the secret of its remote stream). Names are scoped to the user:
another user's queue of the same name is another queue, out of reach. A name is held by
one live writer at a time; the record goes when the writer shuts down, closes or is
dropped, and one left by a writer that died (SIGKILL) is recognized as such (its pid and
start time no longer match a running process): reported and removed by an open of its
name, replaced by a new writer of it, and removed by any new writer's claim.
"""

from __future__ import annotations

import json
import os
import stat
import urllib.parse
import uuid
from typing import Any, Optional

from . import _core

_KINDS = {"queue": "q.", "store": "s."}


def directory() -> str:
    """This user's directory of names."""
    return f"{_core.SHM_DIR}/.shmq-names-{os.getuid()}"


def _check_directory(path: str) -> None:
    """``PermissionError`` if ``path`` is not a directory that this user owns and only
    this user can enter (made by someone else, it could show this user another's queues)."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"{path} is not this user's directory of queue and store names (owner uid "
            f"{st.st_uid}, mode {stat.filemode(st.st_mode)}; this is uid {os.getuid()}): opening "
            "by name is refused until it is removed; handles still work"
        )


def _record_path(kind: str, name: str, create: bool) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if not name or len(name.encode()) > 200 or any(ord(c) < 32 for c in name):
        raise ValueError(f"{name!r} is no {kind} name: 1 to 200 bytes of text with no control characters")
    d = directory()
    if create:
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
    try:
        _check_directory(d)
    except FileNotFoundError:
        pass
    return f"{d}/{_KINDS[kind]}{urllib.parse.quote(name, safe='')}"


def _start_time(pid: int) -> Optional[int]:
    """Process ``pid``'s start time (clock ticks since boot), or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return None
    fields = stat_line[stat_line.rfind(b")") + 2 :].split()
    return int(fields[19])


def _alive(record: dict[str, Any]) -> bool:
    """Whether the process that wrote ``record`` still runs (the same process: pid and
    start time)."""
    return _start_time(record["pid"]) == record["start"]


def claim(kind: str, name: str, details: dict[str, Any]) -> str:
    """Record ``details`` under ``name`` for this process; the token that
    :func:`release` needs. ``FileExistsError`` when a live writer holds the name."""
    path = _record_path(kind, name, create=True)
    _sweep()
    token = uuid.uuid4().hex
    record = {"kind": kind, "name": name, "pid": os.getpid(), "start": _start_time(os.getpid()), "token": token}
    record.update(details)
    tmp = f"{path}.{token}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        try:
            os.link(tmp, path)
        except FileExistsError:
            held = _read(path)
            if held is not None and _alive(held):
                raise FileExistsError(
                    f"a {kind} named {name!r} already exists (made by pid {held['pid']}, which is "
                    f"still running): names are unique per user on this machine"
                ) from None
            # Left by a writer that died: taken over.
            os.replace(tmp, path)
            if (_read(path) or {}).get("token") != token:
                raise FileExistsError(f"a {kind} named {name!r} was just made by another process") from None
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    return token


def _sweep() -> None:
    """Remove the records of writers that died (SIGKILL leaves them): every claim does,
    so that they do not pile up in ``/dev/shm``."""
    d = directory()
    try:
        entries = os.listdir(d)
    except OSError:
        return
    for entry in entries:
        if entry.endswith(".tmp"):
            continue
        path = f"{d}/{entry}"
        record = _read(path)
        if record is not None and not _alive(record):
            try:
                if (_read(path) or {}).get("token") == record["token"]:
                    os.unlink(path)
            except OSError:
                pass


def release(kind: str, name: str, token: str, pid: int) -> None:
    """Remove the record of ``name`` if it is still the one ``token`` wrote, in process
    ``pid`` (a forked child's copy of the writer holds nothing: it leaves the record)."""
    if os.getpid() != pid:
        return
    try:
        path = _record_path(kind, name, create=False)
        record = _read(path)
        if record is not None and record.get("token") == token:
            os.unlink(path)
    except (OSError, ValueError):
        pass  # gone already, or the directory is not ours any more: nothing of ours to remove


def _read(path: str) -> Optional[dict[str, Any]]:
    """The record at ``path``; None when there is none, or what is there is not a whole
    record (never an error of another type: the file is only as good as whoever wrote it)."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if (
        not isinstance(record, dict)
        or type(record.get("pid")) is not int
        or type(record.get("start")) not in (int, type(None))
        or not isinstance(record.get("token"), str)
    ):
        return None
    return record


def lookup(kind: str, name: str) -> dict[str, Any]:
    """The record of the live writer of the ``kind`` named ``name``; ``FileNotFoundError``
    naming it when there is none (never made, ended, or its writer died), ``PermissionError``
    when this user's directory of names is not this user's."""
    path = _record_path(kind, name, create=False)
    how = "MessageQueue(..., name=...)" if kind == "queue" else "an ObjectStorage on RingBuffer(create=True, name=...)"
    record = _read(path)
    if record is None:
        raise FileNotFoundError(
            f"no {kind} named {name!r} on this machine for this user (uid {os.getuid()}): names are "
            f"scoped to the user; was it made with {how}, and is its writer still running?"
        )
    if not _alive(record):
        try:
            if (_read(path) or {}).get("token") == record.get("token"):
                os.unlink(path)
        except OSError:
            pass
        raise FileNotFoundError(
            f"the {kind} named {name!r} is gone: its writer (pid {record['pid']}) is no longer running"
        )
    return record
