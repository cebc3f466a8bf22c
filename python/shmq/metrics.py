"""Live metrics of every shmq queue, store, tensor arena and encoder cache on the machine.

The counters live in the shared-memory segments themselves (atomics that each side
updates as it works, with no lock), so any process that can see ``/dev/shm`` reads them:
no agent, no registration, nothing to start in the processes being watched.

- :func:`collect` returns them as dicts (what ``python -m shmq inspect --json`` prints);
- ``python -m shmq top`` shows a live table with rates;
- :class:`ShmqCollector` exposes them to Prometheus (``prometheus_client``);
  :func:`register_prometheus` adds it to a registry and :func:`start_http_server` serves
  it on its own port. Under vLLM with ``SHMQ_VLLM=1`` the plugin registers it, so vLLM's
  ``/metrics`` shows shmq's metrics next to vLLM's.

A queue's metrics are those of its ring (a queue whose readers are all remote has no
ring, and shows in none of these).
"""

from __future__ import annotations

import os
import re
import sys
import time
import weakref
from typing import Any, Iterator, Optional, Sequence

from . import _core

__all__ = [
    "ShmqCollector",
    "collect",
    "register_prometheus",
    "start_http_server",
    "TopCommand",
]


def collect(names: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    """The metrics of the segments ``names`` (default: every shmq segment in
    ``/dev/shm``), one dict each with ``name``, ``kind`` (``"queue"``, ``"store"``,
    ``"arena"``, ``"encoder_cache"``), ``size``, ``creator_pid``, ``creator_state`` and
    the kind's counters. A segment that goes away while being read is left out."""
    listed = {row[0]: row for row in _core.list_segments()}
    out = []
    for name in names if names is not None else sorted(listed):
        try:
            m = _core.segment_metrics(name)
        except (OSError, ValueError):
            if names is not None and name not in listed:
                raise
            continue  # gone meanwhile, or not a finished shmq segment
        row = listed.get(name)
        if row is not None:
            m["size"], m["creator_pid"], m["creator_state"] = row[1], row[3], row[4]
        out.append(m)
    return out


# --- Prometheus ---------------------------------------------------------------------

# (metric name without shmq_ and without _total, help, field) per kind. Counters get
# `_total` from prometheus_client; gauges are named with their unit.
_QUEUE_COUNTERS = [
    ("queue_sent_messages", "Messages the writer sent.", ("writer", "messages")),
    ("queue_sent_bytes", "Bytes of those messages published in the ring.", ("writer", "bytes")),
    ("queue_overflow_sends", "Messages sent over the local overflow socket.", "overflow_sends"),
    ("queue_arena_parts", "Message parts copied into the tensor arena.", "arena_parts"),
    ("queue_loaned_parts", "Message parts sent from a loan, without a copy.", "loaned_parts"),
    ("queue_fallback_parts", "Large parts copied inline for lack of arena room.", "fallback_parts"),
    ("queue_remote_sends", "Messages sent to remote readers.", "remote_sends"),
    ("queue_writer_waits", "Times the writer waited for readers to free a chunk.", ("writer", "waits")),
    ("queue_writer_wait_seconds", "Time the writer waited for readers.", ("writer", "wait_seconds")),
]
_READER_COUNTERS = [
    ("queue_reader_messages", "Messages a reader read.", "messages"),
    ("queue_reader_bytes", "Bytes of the messages a reader read, as published in the ring.", "bytes"),
    ("queue_reader_waits", "Times a reader waited for the writer.", "waits"),
    ("queue_reader_wait_seconds", "Time a reader waited for the writer.", "wait_seconds"),
]
_READER_GAUGES = [
    ("queue_reader_lag_messages", "Messages the writer sent that a reader has not read.", "behind"),
]
_STORE_COUNTERS = [
    ("store_puts", "Objects put.", "puts"),
    ("store_gets", "Reads counted (gets).", "gets"),
    ("store_evictions", "Objects freed to make room.", "evictions"),
]
_STORE_GAUGES = [
    ("store_objects", "Objects held.", "objects"),
    ("store_used_bytes", "Bytes from the oldest held object to the newest.", "bytes_in_use"),
    ("store_capacity_bytes", "Bytes of the store's ring.", "capacity"),
    ("store_views_held", "Zero-copy gets still holding their object's memory.", "views_held"),
]
_ARENA_COUNTERS = [
    ("arena_fallbacks", "Parts copied inline because the arena had no room.", "fallbacks"),
]
_ARENA_GAUGES = [
    ("arena_used_bytes", "Bytes of the arena in use.", "bytes_in_use"),
    ("arena_reserved_bytes", "Bytes of the arena reserved in /dev/shm.", "reserved"),
    ("arena_capacity_bytes", "Bytes of the arena.", "capacity"),
]
_CACHE_COUNTERS = [
    ("encoder_cache_saves", "Entries saved.", "saves"),
    ("encoder_cache_loads", "Entries loaded by consumers.", "loads"),
    ("encoder_cache_evictions", "Entries evicted.", "evictions"),
    ("encoder_cache_waits", "Producer waits (for room, or for consumers).", "waits"),
    ("encoder_cache_wait_seconds", "Time the producer waited.", "wait_seconds"),
]
_CACHE_GAUGES = [
    ("encoder_cache_entries", "Entries held.", "entries"),
    ("encoder_cache_used_bytes", "Bytes of the entries held.", "bytes_in_use"),
    ("encoder_cache_capacity_bytes", "Bytes of the cache.", "capacity"),
]


# A segment name shmq made up (``shmq_<kind>_<pid>_<hex>``), not one its user chose.
_MADE_UP = re.compile(r"shmq_[a-z]+_[0-9]+_[0-9a-f]+")


def _store_name(segment: str) -> str:
    """The ``store`` label: the name the store was made with (a named store's segment is
    its name: ``RingBuffer(name=...)``, as vLLM names its multimodal store), or ``""``
    for a store whose segment name shmq made up."""
    return "" if _MADE_UP.fullmatch(segment) else segment


def _cache_name(segment: str) -> str:
    """The ``cache`` label: the name consumers open an encoder cache by (its segment is
    ``shmq_ec_<name>``)."""
    return segment.removeprefix("shmq_ec_")


def _field(m: dict[str, Any], field: Any) -> float:
    if isinstance(field, tuple):
        return float(m[field[0]][field[1]])
    return float(m[field])


class ShmqCollector:
    """A ``prometheus_client`` collector of every shmq segment on the machine (read at
    each scrape). Labels: ``segment``; a queue's also ``queue`` (the name its writer gave
    it, ``MessageQueue(name=...)``; empty for none) and, for its readers, ``reader``."""

    def describe(self) -> list[Any]:
        # Metric names are fixed, but which exist depends on the segments: describe
        # nothing, so registering never scrapes.
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        def families(specs: list[tuple[str, str, Any]], kind: type, labels: list[str]) -> dict[str, Any]:
            return {name: kind(f"shmq_{name}", text, labels=labels) for name, text, _ in specs}

        counters: dict[str, Any] = {}
        gauges: dict[str, Any] = {}
        by_labels: list[tuple[list[tuple[str, str, Any]], list[str]]]
        by_labels = [
            (_QUEUE_COUNTERS, ["segment", "queue"]),
            (_READER_COUNTERS, ["segment", "queue", "reader"]),
            (_STORE_COUNTERS, ["segment", "store"]),
            (_ARENA_COUNTERS, ["segment"]),
            (_CACHE_COUNTERS, ["segment", "cache"]),
        ]
        for specs, labels in by_labels:
            counters.update(families(specs, CounterMetricFamily, labels))
        by_labels = [
            (_READER_GAUGES, ["segment", "queue", "reader"]),
            (_STORE_GAUGES, ["segment", "store"]),
            (_ARENA_GAUGES, ["segment"]),
            (_CACHE_GAUGES, ["segment", "cache"]),
        ]
        for specs, labels in by_labels:
            gauges.update(families(specs, GaugeMetricFamily, labels))
        readers_up = GaugeMetricFamily(
            "shmq_queue_reader_up",
            "1 while a queue's reader is alive (not proved dead), else 0.",
            labels=["segment", "queue", "reader"],
        )

        def add(specs: list[tuple[str, str, Any]], into: dict[str, Any], m: dict[str, Any], labels: list[str]) -> None:
            for name, _, field in specs:
                into[name].add_metric(labels, _field(m, field))

        for m in collect():
            seg = [m["name"]]
            kind = m["kind"]
            if kind == "queue":
                queue = seg + [m["label"] or ""]
                add(_QUEUE_COUNTERS, counters, m, queue)
                for r in m["readers"]:
                    labels = queue + [str(r["reader"])]
                    add(_READER_COUNTERS, counters, r, labels)
                    add(_READER_GAUGES, gauges, r, labels)
                    readers_up.add_metric(labels, 0.0 if r["state"] == "dead" or r["dropped"] else 1.0)
            elif kind == "store":
                store = seg + [_store_name(m["name"])]
                add(_STORE_COUNTERS, counters, m, store)
                add(_STORE_GAUGES, gauges, m, store)
            elif kind == "arena":
                add(_ARENA_COUNTERS, counters, m, seg)
                add(_ARENA_GAUGES, gauges, m, seg)
            elif kind == "encoder_cache":
                cache = seg + [_cache_name(m["name"])]
                add(_CACHE_COUNTERS, counters, m, cache)
                add(_CACHE_GAUGES, gauges, m, cache)
        yield from counters.values()
        yield from gauges.values()
        yield readers_up


# Registry -> its collector; weak, so that a registry that goes away (vLLM builds one per
# call in multiprocess mode) takes its entry with it and its id is never mistaken for
# a later registry's.
_registered: "weakref.WeakKeyDictionary[Any, ShmqCollector]" = weakref.WeakKeyDictionary()


def register_prometheus(registry: Any = None) -> ShmqCollector:
    """Add a :class:`ShmqCollector` to ``registry`` (default: ``prometheus_client``'s
    global ``REGISTRY``, the one ``prometheus_client.start_http_server`` and most web
    frameworks serve); once per registry. Needs ``prometheus_client``
    (``pip install 'shmq[prometheus]'``)."""
    try:
        import prometheus_client
    except ImportError as e:
        raise ImportError("shmq's Prometheus metrics need prometheus_client: pip install 'shmq[prometheus]'") from e
    if registry is None:
        registry = prometheus_client.REGISTRY
    collector = _registered.get(registry)
    if collector is None:
        collector = ShmqCollector()
        registry.register(collector)
        _registered[registry] = collector
    return collector


def start_http_server(port: int, addr: str = "127.0.0.1") -> Any:
    """Serve shmq's metrics (and whatever else is in ``prometheus_client``'s global
    registry) on ``http://addr:port/metrics`` from a daemon thread; returns what
    ``prometheus_client.start_http_server`` returns.

    ``addr`` defaults to ``127.0.0.1``: only this machine can read the metrics (segment
    names, process ids and rates say what runs here). Pass ``addr="0.0.0.0"`` (or one
    interface's address, ``"::"`` for IPv6) for a Prometheus server on another machine.
    (``prometheus_client``'s own default is ``0.0.0.0``.)"""
    register_prometheus()
    import prometheus_client

    return prometheus_client.start_http_server(port, addr=addr)


# --- python -m shmq top -------------------------------------------------------------


def _rate(now: float, before: Optional[float], seconds: float) -> str:
    if before is None or seconds <= 0:
        return "-"
    return f"{(now - before) / seconds:,.0f}/s"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def _rows(now: list[dict[str, Any]], before: dict[str, dict[str, Any]], seconds: float) -> list[str]:
    lines = []
    for m in now:
        b = before.get(m["name"])
        kind = m["kind"]
        if kind == "queue":
            w = m["writer"]
            prev = b["writer"]["messages"] if b else None
            readers = m["readers"]
            lag = max((r["behind"] for r in readers), default=0)
            waiting = sum(r["waiting_seconds"] is not None for r in readers)
            named = f" {m['label']!r}" if m["label"] else ""
            lines.append(
                f"{m['name']:<34} queue{named}   writer pid {w['pid']} ({w['state']}) "
                f"{w['messages']:,} msgs {_rate(w['messages'], prev, seconds)}, "
                f"{m['n_reader']} readers (max lag {lag}, {waiting} waiting), "
                f"overflow {m['overflow_sends']}, arena {m['arena_parts']}, loans {m['loaned_parts']}, "
                f"fallbacks {m['fallback_parts']}, writer waited {w['wait_seconds']:.2f} s"
            )
            for r in readers:
                prev_r = b["readers"][r["reader"]]["messages"] if b else None
                doing = (
                    "stopped"
                    if r["stopped"]
                    else "waiting in the queue"
                    if r["waiting_seconds"] is not None
                    else "busy elsewhere"
                )
                lines.append(
                    f"{'':<34}   reader {r['reader']}: pid {r['pid']} "
                    f"({r['state']}{', dropped' if r['dropped'] else ''}) "
                    f"{r['messages']:,} msgs {_rate(r['messages'], prev_r, seconds)}, {r['behind']} behind, {doing}"
                )
        elif kind == "store":
            prev_p = b["puts"] if b else None
            prev_g = b["gets"] if b else None
            lines.append(
                f"{m['name']:<34} store   {m['objects']} objects, "
                f"{_human(m['bytes_in_use'])} of {_human(m['capacity'])}; "
                f"puts {m['puts']:,} {_rate(m['puts'], prev_p, seconds)}, "
                f"gets {m['gets']:,} {_rate(m['gets'], prev_g, seconds)}, "
                f"evictions {m['evictions']:,}, views held {m['views_held']}"
            )
        elif kind == "arena":
            lines.append(
                f"{m['name']:<34} arena   {_human(m['bytes_in_use'])} in use of {_human(m['capacity'])} "
                f"({_human(m['reserved'])} reserved), fallbacks {m['fallbacks']:,}"
            )
        elif kind == "encoder_cache":
            prev_s = b["saves"] if b else None
            lines.append(
                f"{m['name']:<34} encoder cache ({m['state']}) {m['entries']} entries, {_human(m['bytes_in_use'])} of "
                f"{_human(m['capacity'])}; saves {m['saves']:,} {_rate(m['saves'], prev_s, seconds)}, "
                f"loads {m['loads']:,}, "
                f"evictions {m['evictions']:,}, waits {m['waits']} ({m['wait_seconds']:.2f} s)"
            )
    return lines


class TopCommand:
    """A live table of every shmq queue, store, arena and encoder cache on this machine,
    with rates, refreshed every --interval seconds (Ctrl-C ends it)."""

    @staticmethod
    def add_arguments(parser: Any) -> None:
        parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
        parser.add_argument(
            "--count", type=int, default=0, help="stop after this many refreshes (default: until Ctrl-C)"
        )

    @staticmethod
    def main(args: Any) -> int:
        if args.interval <= 0:
            print("error: --interval must be positive", file=sys.stderr)
            return 2
        before: dict[str, dict[str, Any]] = {}
        last = time.monotonic()
        shown = 0
        clear = sys.stdout.isatty()
        while True:
            now_t = time.monotonic()
            now = collect()
            lines = _rows(now, before, now_t - last)
            if clear:
                sys.stdout.write("\x1b[H\x1b[2J")
            stamp = time.strftime("%H:%M:%S")
            print(f"shmq top  {stamp}  {len(now)} segment(s) in /dev/shm (pid {os.getpid()} reading)")
            print("\n".join(lines) if lines else "(no shmq segments)", flush=True)
            before = {m["name"]: m for m in now}
            last = now_t
            shown += 1
            if args.count and shown >= args.count:
                return 0
            time.sleep(args.interval)
