"""Queues and stores by name: ``MessageQueue.open(name, rank)`` and
``ObjectStorage.open(name)``, for processes of the same user on this machine, in either
language: a thin layer over the Rust core's ``shmq::names`` (``_core.names_*``), which
Rust's ``QueueOptions::record_name`` and ``Reader::open_by_name`` use too, so a name one
language holds is found, and refused to a second writer, by the other.

A writer made with a name (``MessageQueue(..., name=...)``, an ``ObjectStorage`` on a
``RingBuffer(create=True, name=...)``) records its handle under that name: one JSON
file per name (``{"kind": ..., "name": ..., "pid": ..., ...details}``, owner-only: a
queue's handle holds the secret of its remote stream) in a directory of this user's own
(mode 0700), ``/dev/shm/.shmq-names-<uid>``, or the first of ``.shmq-names-<uid>.1``,
``.2``, ... of this user's where a stranger took that entry first (a warning names it),
or the directory ``SHMQ_NAMES_DIR`` names. A directory of the user's own that others may
enter is refused (``PermissionError``): it could show this user another's queues.

Who holds a name is told by a lock its writer holds on the record (never by its pid, so
a writer in another pid namespace sharing ``/dev/shm`` is seen alive); only a record
proved dead is removed or taken over, without a race between removers and new writers;
another user's record is never read nor removed. The whole protocol is documented in
``crates/os/src/names_dir.rs`` (the files) and ``crates/core/src/names.rs`` (the records).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from . import _core

#: Names a directory to keep this user's names in instead of ``/dev/shm/.shmq-names-<uid>``.
DIRECTORY_ENV = _core.NAMES_DIRECTORY_ENV

#: A name held by this process: ``release()`` removes its record and lets the name go;
#: without it, the name is held until the process ends (a forked child's copy holds
#: nothing).
Claim = _core.NameClaim


def directory(create: bool = False) -> Optional[str]:
    """This user's directory of names; None when there is none yet and ``create`` is
    false. ``PermissionError`` when the one found may be entered by others, or when
    ``SHMQ_NAMES_DIR`` names no directory of this user's."""
    return _core.names_directory(create)


def _record_path(kind: str, name: str, create: bool) -> Optional[str]:
    """Where the record of ``name`` is (or would be); None when this user has no directory
    of names yet and ``create`` is false."""
    return _core.names_record_path(kind, name, create)


def claim(kind: str, name: str, details: dict[str, Any]) -> Claim:
    """Record ``details`` under ``name`` for this process; the name is held until the
    returned claim's ``release()`` (or this process's end, also if the claim is collected
    first). ``FileExistsError`` when a
    live writer holds the name, or one whose liveness cannot be told; ``ValueError`` for a
    name that is not 1 to 200 bytes of text without control characters."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    return _core.names_claim(kind, name, json.dumps(details))


def lookup(kind: str, name: str) -> dict[str, Any]:
    """The record of the live writer of the ``kind`` named ``name``; ``FileNotFoundError``
    naming it when there is none (never made, ended, or its writer died: proved by its
    lock, then its record is removed), ``PermissionError`` when this user's directory of
    names may be entered by others. A record whose writer's liveness cannot be told is
    returned as it is (the handle in it says whether the writer is there)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    record: dict[str, Any] = json.loads(_core.names_lookup(kind, name))
    return record
