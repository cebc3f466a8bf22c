"""Finding, inspecting and removing shmq's shared-memory segments.

Every segment shmq creates is named ``shmq_*`` in ``/dev/shm`` and records the process
that created it. A clean exit removes it; a crash (``SIGKILL``, a segfault) leaves it
behind, holding memory until the machine reboots. ``cleanup`` removes the segments whose
creator is gone; processes that still map one keep their mapping.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

from . import _core

__all__ = ["SegmentInfo", "cleanup", "inspect", "list_segments"]


@dataclass(frozen=True)
class SegmentInfo:
    name: str
    size: int
    kind: str
    creator_pid: Optional[int]
    creator_alive: bool


def list_segments() -> list[SegmentInfo]:
    """Every shmq segment on this machine (in this container's ``/dev/shm``)."""
    return [SegmentInfo(*row) for row in _core.list_segments()]


def cleanup(dry_run: bool = False) -> list[SegmentInfo]:
    """Remove the segments whose creator has died (with ``dry_run``, only find them)."""
    return [SegmentInfo(*row) for row in _core.remove_orphans(dry_run)]


def inspect(name: str) -> str:
    """A description of a live queue's or store's state: its readers and writer (pids,
    alive or not, messages handled), chunk flags and overflow count, or the store's
    occupancy."""
    return _core.describe_segment(name)


class CleanupCommand:
    """Remove shmq segments left in /dev/shm by processes that crashed.

    A segment is removed only if the process that created it is gone (checked by pid and
    start time, so a reused pid does not count). Segments of live processes are kept."""

    @staticmethod
    def add_arguments(parser) -> None:
        parser.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")

    @staticmethod
    def main(args) -> int:
        found = cleanup(dry_run=args.dry_run)
        verb = "would remove" if args.dry_run else "removed"
        for s in found:
            pid = f"pid {s.creator_pid}" if s.creator_pid is not None else "unknown creator"
            print(f"{verb} {s.name} ({s.kind}, {s.size} bytes, {pid} is gone)")
        kept = [s for s in list_segments() if s.creator_alive]
        print(f"{verb} {len(found)} segment(s); {len(kept)} segment(s) of live processes kept")
        return 0


class InspectCommand:
    """Print the state of a live queue or store: its writer and readers (pids, alive or
    not, messages handled), chunk flags and overflow count, or the store's occupancy."""

    @staticmethod
    def add_arguments(parser) -> None:
        parser.add_argument("name", nargs="?", help="segment name (shmq_...); without it, list all segments")

    @staticmethod
    def main(args) -> int:
        if args.name is None:
            for s in list_segments():
                state = "alive" if s.creator_alive else "dead"
                print(f"{s.name}  {s.kind}  {s.size} bytes  creator pid {s.creator_pid} ({state})")
            return 0
        try:
            print(inspect(args.name), end="")
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
