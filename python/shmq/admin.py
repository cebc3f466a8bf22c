"""Finding, inspecting and removing shmq's shared-memory segments.

Every segment shmq creates is named ``shmq_*`` in ``/dev/shm`` and records the process
that created it. A clean exit removes it; a crash (``SIGKILL``, a segfault) leaves it
behind, holding memory until the machine reboots. ``cleanup`` removes the segments whose
creator is gone; processes that still map one keep their mapping.

Whether a creator is alive is read off a lock it holds on the segment's file for as long
as it lives (so it works across pid namespaces: containers that share ``/dev/shm``, where
pids mean nothing). A creator is ``"alive"``, ``"dead"`` (proved: only those segments are
removed) or ``"unknown"`` (cannot be told from here: kept unless ``force``).
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
    #: "alive", "dead" or "unknown" (see the module docs).
    creator_state: str

    @property
    def creator_alive(self) -> bool:
        """Not proved dead: alive, or unknown (either way, kept by ``cleanup``)."""
        return self.creator_state != "dead"


def list_segments() -> list[SegmentInfo]:
    """Every shmq segment on this machine (in this container's ``/dev/shm``)."""
    return [SegmentInfo(*row) for row in _core.list_segments()]


def cleanup(dry_run: bool = False, force: bool = False) -> list[SegmentInfo]:
    """Remove the segments whose creator is proved dead (with ``dry_run``, only find
    them); with ``force``, also those whose creator cannot be judged from here."""
    return [SegmentInfo(*row) for row in _core.remove_orphans(dry_run, force)]


def inspect(name: str) -> str:
    """A description of a live queue's or store's state: its readers and writer (pids,
    alive or not, messages handled), chunk flags and overflow count, or the store's
    occupancy."""
    return _core.describe_segment(name)


class CleanupCommand:
    """Remove shmq segments left in /dev/shm by processes that crashed.

    A segment is removed only if the process that created it is proved gone (its lock on
    the segment is free). Segments of live processes are kept, and so are those whose
    creator cannot be judged from here (unless --force)."""

    @staticmethod
    def add_arguments(parser) -> None:
        parser.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
        parser.add_argument(
            "--force",
            action="store_true",
            help="also remove segments whose creator cannot be judged from here (another pid namespace "
            "without a shared /dev/shm view, no permission): only if you know they are unused",
        )

    @staticmethod
    def main(args) -> int:
        found = cleanup(dry_run=args.dry_run, force=args.force)
        verb = "would remove" if args.dry_run else "removed"
        for s in found:
            pid = f"pid {s.creator_pid}" if s.creator_pid is not None else "unknown creator"
            why = "is gone" if s.creator_state == "dead" else "cannot be judged (--force)"
            print(f"{verb} {s.name} ({s.kind}, {s.size} bytes, {pid} {why})")
        rest = list_segments()
        alive = sum(s.creator_state == "alive" for s in rest)
        unknown = [s for s in rest if s.creator_state == "unknown"]
        print(f"{verb} {len(found)} segment(s); {alive} segment(s) of live processes kept")
        if unknown:
            print(f"kept {len(unknown)} segment(s) whose creator cannot be judged from here (--force removes them)")
        return 0


def _queue_name(s: SegmentInfo) -> str:
    """`` of queue "name"`` for a ring whose writer named its queue, else ``""``."""
    if s.kind != "broadcast ring":
        return ""
    try:
        label = _core.segment_metrics(s.name).get("label")
    except (OSError, ValueError):  # gone meanwhile, or not readable
        return ""
    return f' of queue "{label}"' if label else ""


class InspectCommand:
    """Print the state of a live queue or store: its writer and readers (pids, alive or
    not, messages handled), chunk flags and overflow count, or the store's occupancy."""

    @staticmethod
    def add_arguments(parser) -> None:
        parser.add_argument("name", nargs="?", help="segment name (shmq_...); without it, list all segments")
        parser.add_argument(
            "--json",
            action="store_true",
            help="print the live metrics (of the segment, or of every segment) as JSON: see shmq.metrics",
        )

    @staticmethod
    def main(args) -> int:
        if args.json:
            import json

            from . import metrics

            try:
                found = metrics.collect([args.name] if args.name else None)
            except (FileNotFoundError, ValueError, OSError) as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            print(json.dumps(found[0] if args.name else found, indent=2))
            return 0
        if args.name is None:
            for s in list_segments():
                kind = f"{s.kind}{_queue_name(s)}"
                print(f"{s.name}  {kind}  {s.size} bytes  creator pid {s.creator_pid} ({s.creator_state})")
            return 0
        try:
            print(inspect(args.name), end="")
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
