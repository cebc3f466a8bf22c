"""Running every scenario and printing the table: ``run_bench``, the formatting, and
the ``bench`` subcommand's ``add_arguments`` / ``main``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional, Sequence

from .common import (
    MAX_CHUNK_BYTES,
    MAX_CHUNKS,
    TORCH_HINT,
    MiB,
    NotMeasured,
    PROTOCOL,
    SMALL_OBJECT,
    STEP_OBJECT,
    BenchError,
    Skip,
    array_lib,
)
from .harness import STALL_S, Harness
from .scenarios import FLOORS, PRESETS, SCENARIOS, Floor, Params, Scenario
from .transports import TRANSPORTS, Transport


@dataclass
class Row:
    """One table row: a metric's value per transport (or one value for a floor)."""

    key: str  # "<scenario key>.<metric key>", stable for readers of the JSON
    label: str
    unit: str
    higher_is_better: bool
    values: dict[str, Optional[float]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    #: Cells that could not run here (transport name, or FLOOR_CELL) -> what they need.
    skipped: dict[str, str] = field(default_factory=dict)
    floor: Optional[float] = None
    #: A floor row: one value (``floor``), or its error / skip under FLOOR_CELL.
    is_floor: bool = False
    #: The title of the scenario or floor the row comes from.
    group: str = ""
    #: A floor shown right under its scenario's rows (not in the floors at the end).
    inline: bool = False
    #: Cells whose figure stands but comes with a note (a slow run): transport -> note.
    notes: dict[str, str] = field(default_factory=dict)


#: The key of a floor row's one cell in ``Row.errors`` / ``Row.skipped``.
FLOOR_CELL = "floor"


class Progress:
    """One status line on stderr, rewritten in place on a terminal."""

    def __init__(self, total: int, stream: Any = sys.stderr, enabled: bool = True):
        self.total, self.done, self.stream, self.enabled = total, 0, stream, enabled
        self.tty = enabled and stream.isatty()
        self.started = time.monotonic()

    def step(self, text: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        line = f"[{self.done}/{self.total}, {time.monotonic() - self.started:.1f} s] {text}"
        self.stream.write(f"\r\x1b[K{line}" if self.tty else line + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def machine_info() -> dict[str, Any]:
    """Where the figures were measured."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        nproc = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        nproc = os.cpu_count() or 0
    try:
        from shmq import __version__ as shmq_version
    except ImportError:  # pragma: no cover
        shmq_version = "?"
    try:
        import zmq

        zmq_version = f"{zmq.__version__} (libzmq {zmq.zmq_version()})"
    except ImportError:
        zmq_version = None
    try:
        import torch

        torch_version: Optional[str] = torch.__version__
    except ImportError:
        torch_version = None
    try:
        from importlib.metadata import version

        vllm_version: Optional[str] = version("vllm")
    except Exception:  # noqa: BLE001 - not installed
        vllm_version = None
    return {
        "nproc": nproc,
        "cpu": cpu,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "kernel": platform.release(),
        "shmq": shmq_version,
        "pyzmq": zmq_version,
        "torch": torch_version,
        "vllm": vllm_version,
        "busy_before": _cpu_busy(),
    }


def _cpu_busy(interval: float = 0.25) -> Optional[float]:
    """Fraction of all CPUs busy (from /proc/stat) over ``interval`` seconds: other
    work on the machine before the run, which makes the figures noisy."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields[:8]) - idle, sum(fields[:8])

    try:
        busy0, total0 = sample()
        time.sleep(interval)
        busy1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (busy1 - busy0) / max(1, total1 - total0)


def _median_of(runs: int, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Call ``measure`` ``runs`` times; the median of each metric (a metric that was not
    measured in some run, a ``NotMeasured``, stays so)."""
    results = [measure() for _ in range(runs)]
    out: dict[str, Any] = {}
    for key in results[0]:
        values = [r.get(key) for r in results]
        numbers = [v for v in values if isinstance(v, (int, float))]
        out[key] = statistics.median(numbers) if len(numbers) == len(values) else next(
            v for v in values if not isinstance(v, (int, float))
        )
    return out


def selected(params: Params, only: Sequence[str] = ()) -> list[Scenario]:
    """The scenarios this run measures: those that apply to the preset's tensor sizes
    and, if ``only`` is given, whose key starts with one of its entries."""
    return [s for s in SCENARIOS if s.applies(params) and (not only or any(s.key.startswith(o) for o in only))]


def selected_floors(only: Sequence[str] = ()) -> list[Floor]:
    """The floors this run measures: all of them without ``only`` or with "floors" in it,
    else those whose key starts with one of its entries."""
    if not only or "floors" in only:
        return list(FLOORS)
    return [f for f in FLOORS if any(f.key.startswith(o) for o in only)]


def _labelled(label: str, params: Params) -> str:
    """A metric's label with what the tensor rows send filled in."""
    return label.replace("{tensor}", "tensor" if params.arrays == "torch" else "numpy array")


def _context(params: Params, transports: Sequence[Transport], floors: Sequence[Floor]) -> Any:
    """The ``multiprocessing`` context every child process starts from. With
    "forkserver", its server is started now and imports once what the children will
    need (:mod:`.preload`: torch, pyzmq, vLLM's queue and encoder-cache region where they
    take part, whether or not they can be imported here), so that each child starts in
    milliseconds instead of importing them again (seconds each, on 2 cores); it does so
    while this process goes on."""
    import multiprocessing

    ctx = multiprocessing.get_context(params.start_method)
    if params.start_method != "forkserver":
        return ctx
    from multiprocessing import forkserver

    from . import preload

    names = {t.name for t in transports}
    modules = ["shmq", "shmq_bench.roles", "shmq_bench.encoder_cache", "numpy"]
    if params.arrays == "torch":
        modules += ["torch", "torch.multiprocessing"]
    if "pyzmq" in names:
        modules.append("zmq")
    if names & {"vLLM", "vLLM arena"}:
        modules.append("vllm.distributed.device_communicators.shm_broadcast")
    if any(f.key == "encoder_cache" for f in floors) and params.arrays == "torch":
        # (its worker module is imported by the consumers: it is quick, and it logs)
        modules.append("vllm.distributed.ec_transfer.ec_connector.cpu.ec_shared_region")
    os.environ[preload.ENV] = ",".join(modules)
    ctx.set_forkserver_preload([preload.__name__])
    forkserver.ensure_running()  # a no-op once it runs (the preload of the first call stays)
    return ctx


def _floor_rows(floor: Floor, params: Params, repeat: int, details: list[str], inline: bool = False) -> list[Row]:
    """Measure ``floor`` (``repeat`` times, the median); its rows, each with its value,
    or its skip or error (a floor that raises takes only its own rows with it)."""
    try:
        result = _median_of(repeat, partial(floor.run, params))
    except Skip as e:
        result = {m.key: NotMeasured(str(e)) for m in floor.metrics}
    except Exception as e:  # noqa: BLE001 - shown in the table, the run goes on
        message = str(e) if isinstance(e, BenchError) else f"{type(e).__name__}: {e}"
        result = {m.key: NotMeasured(message, failed=True) for m in floor.metrics}
        details.append(f"{floor.title}:\n{e.details if isinstance(e, BenchError) else traceback.format_exc()}")
    rows = []
    for m in floor.metrics:
        label = _labelled(m.label, params)
        row = Row(
            f"{floor.key}.{m.key}", label, m.unit, m.higher_is_better, is_floor=True, group=floor.title, inline=inline
        )
        value = result.get(m.key, NotMeasured("not measured here", failed=True))
        if isinstance(value, NotMeasured):
            (row.errors if value.failed else row.skipped)[FLOOR_CELL] = value.reason
        else:
            row.floor = value
        rows.append(row)
    return rows


def run_bench(
    params: Params,
    transports: Sequence[Transport],
    timeout: float,
    repeat: int = 1,
    progress: Optional[Progress] = None,
    details: Optional[list[str]] = None,
    scenarios: Optional[Sequence[Scenario]] = None,
    floors: Optional[Sequence[Floor]] = None,
    stall: float = STALL_S,
) -> list[Row]:
    """Run every scenario (default: :func:`selected`) for every transport that can run it
    (``repeat`` times, keeping the median), each followed by its own floors, then the
    floors (default: all); returns the rows. Failures land in ``Row.errors`` (and their
    tracebacks in ``details``), cells that cannot run here (a transport or library not
    installed) in ``Row.skipped``: no failure stops the run. A run fails only when it
    makes no progress for ``stall`` seconds; one slower than ``timeout`` keeps its
    figures, with a note in ``Row.notes``."""
    details = details if details is not None else []
    scenarios = selected(params) if scenarios is None else scenarios
    floors = FLOORS if floors is None else floors
    ctx = _context(params, transports, floors)
    rows: list[Row] = []
    workdir = tempfile.mkdtemp(prefix="shmq-bench-")
    try:
        harness = Harness(ctx, workdir, timeout, stall)
        for scenario in scenarios:
            scenario_rows = [
                Row(
                    f"{scenario.key}.{m.key}",
                    _labelled(m.label, params),
                    m.unit,
                    m.higher_is_better,
                    group=scenario.title,
                )
                for m in scenario.metrics
            ]
            rows += scenario_rows
            for transport in transports:
                if scenario.only is not None and transport.name not in scenario.only:
                    continue  # a cell left empty ("-")
                if progress:
                    progress.step(f"{scenario.title} - {transport.name}")
                try:
                    reason = transport.unavailable()
                    if reason is not None:
                        raise Skip(reason)
                    harness.take_notes()
                    result = _median_of(repeat, partial(scenario.run, harness, transport, params))
                    notes = harness.take_notes()
                    for row in scenario_rows if notes else ():
                        row.notes[transport.name] = notes[-1]
                except Skip as e:
                    for row in scenario_rows:
                        row.values[transport.name] = None
                        row.skipped[transport.name] = str(e)
                    continue
                except Exception as e:  # noqa: BLE001 - BenchError, or a bug: shown, the run goes on
                    for row in scenario_rows:
                        row.values[transport.name] = None
                        row.errors[transport.name] = str(e) if isinstance(e, BenchError) else f"{type(e).__name__}: {e}"
                    more = e.details if isinstance(e, BenchError) else traceback.format_exc()
                    if more:
                        details.append(f"{scenario.title} - {transport.name}:\n{more}")
                    continue
                for metric, row in zip(scenario.metrics, scenario_rows, strict=True):
                    row.values[transport.name] = result[metric.key]
            for floor in scenario.floors:
                if progress:
                    progress.step(floor.title)
                rows += _floor_rows(floor, params, repeat, details, inline=True)
        for floor in floors:
            if progress:
                progress.step(floor.title)
            rows += _floor_rows(floor, params, repeat, details)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if progress:
            progress.finish()
    return rows


def _format_value(value: Optional[float], unit: str, missing: bool = False, skipped: bool = False) -> str:
    if missing:
        return "-"
    if skipped:
        return "skipped"
    if value is None:
        return "failed"
    if unit == "us":
        return f"{value:.2f} µs" if value < 100 else f"{value:.0f} µs"
    if unit == "obj/s":
        return f"{value / 1000:,.0f} k/s" if value >= 10_000 else f"{value / 1000:.2f} k/s"
    if unit == "%":
        return f"{value:.2f} %"
    if unit == "GB/s":
        return f"{value:.1f} GB/s"
    if unit == "ms":
        return f"{value:.2f} ms" if value < 100 else f"{value:.0f} ms"
    if unit == "":
        return f"{value:.0f}"
    return f"{value:.3g} {unit}"


def _format_ratio(row: Row, a: str, b: str) -> str:
    """How ``a`` compares with ``b`` in this row, e.g. ``7.3x faster``."""
    va, vb = row.values.get(a), row.values.get(b)
    if not va or not vb or row.unit in ("x", ""):  # ratios and counts are not compared
        return ""
    ratio = va / vb if row.higher_is_better else vb / va
    better, worse = ("less", "more") if row.unit == "%" else ("faster", "slower")
    return f"{ratio:.1f}x {better}" if ratio >= 1 else f"{1 / ratio:.1f}x {worse}"


def format_table(rows: Sequence[Row], names: Sequence[str], reference: str = "shmq") -> str:
    """The result table: one column per transport, then ratios of ``reference`` to the
    others. A floor row shows its single value in the first column."""
    others = [n for n in names if n != reference] if reference in names else []
    header = ["scenario", *names, *(f"{reference} vs {n}" for n in others)]
    body: list[Optional[list[str]]] = []
    for i, row in enumerate(rows):
        if row.is_floor and not row.inline and i > 0 and (not rows[i - 1].is_floor or rows[i - 1].inline):
            body.append(None)  # a rule between the transports' rows and the floors
        if row.is_floor:
            first = _format_value(row.floor, row.unit, skipped=FLOOR_CELL in row.skipped)
            cells = [first] + ["-"] * (len(names) - 1) + [""] * len(others)
        else:
            cells = [
                _format_value(row.values.get(n), row.unit, n not in row.values, n in row.skipped)
                + (" (slow)" if n in row.notes and row.values.get(n) is not None else "")
                for n in names
            ]
            cells += [_format_ratio(row, reference, n) for n in others]
        body.append([row.label, *cells])
    widths = [max(len(r[i]) for r in [header, *body] if r) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        return "  ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))]).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) if r else rule for r in body)])


def _step_rounds(params: Params) -> str:
    """The step latency's counts, where they differ from the small object's."""
    if params.step_rounds is None or params.step_rounds >= params.rounds:
        return ""
    return f" (the step's: {params.step_rounds:,} after {min(params.warmup, max(1, params.step_rounds // 10)):,})"


def _header(machine: dict[str, Any], params: Params, repeat: int) -> str:
    """What was measured where: the lines printed above the table."""
    lines = [
        f"shmq {machine['shmq']} bench on {machine['nproc']} CPUs ({machine['cpu']}), "
        f"{machine['implementation']} {machine['python']}, Linux {machine['kernel']}"
        + (f", pyzmq {machine['pyzmq']}" if machine["pyzmq"] else ""),
        f"latency: half the round trip, p50/p99 over {params.rounds:,} round trips after {params.warmup:,} "
        f"warm-up{_step_rounds(params)}; throughput: {params.objects:,} objects, first send to last receive",
        f"small object of {len(pickle.dumps(SMALL_OBJECT, PROTOCOL))} bytes pickled; 64-request step of "
        f"{len(pickle.dumps(STEP_OBJECT, PROTOCOL)):,} bytes pickled; shmq queues of {MAX_CHUNKS} x "
        f"{MAX_CHUNK_BYTES // MiB} MiB chunks" + (f"; median of {repeat} runs per cell" if repeat > 1 else ""),
        "tensor rows: 'fresh' = a new float32 array made by the writer for every send (inside the clock), "
        f"each reader copies all of it into its own buffer ({params.fresh_warmup} warm-up messages, 3 over "
        "16 MiB); 'hand-over only' = the same array every send, one element read"
        + ("; torch at 1 thread per process" if params.arrays == "torch" else ""),
        "processes: "
        + (
            "spawned (each imports what it needs)"
            if params.start_method == "spawn"
            else f"started by {params.start_method} (the modules they need imported once, in its server)"
        )
        + (f"; torch {machine['torch']}" if machine.get("torch") else "")
        + (f"; vLLM {machine['vllm']}" if machine.get("vllm") else ""),
    ]
    busy = machine["busy_before"]
    if busy is not None and busy > 0.1:
        lines.append(f"note: other work kept {busy:.0%} of the CPUs busy just before the run; figures will be noisy")
    return "\n".join(lines)


DEFAULT_TRANSPORTS = ",".join(t.name for t in TRANSPORTS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's options."""
    parser.add_argument(
        "--quick",
        dest="preset",
        action="store_const",
        const="quick",
        default="default",
        help="a check that every row runs, in under a minute: 5 000 round trips after 500 warm-up, 10 000 "
        "objects, 16 MiB tensors only and fewer of them, processes forked from a server that imported torch and "
        "vLLM once; instead of the standard 20 000 after 1 000, 50 000, 1/16/256 MiB, spawned processes",
    )
    parser.add_argument("--rounds", type=int, metavar="N", help="ping-pong round trips to measure")
    parser.add_argument("--warmup", type=int, metavar="N", help="ping-pong round trips before measuring")
    parser.add_argument("--objects", type=int, metavar="N", help="objects per throughput run")
    parser.add_argument(
        "--transports",
        metavar="LIST",
        default=DEFAULT_TRANSPORTS,
        help="comma-separated subset of: %(default)s (those not installed are left out)",
    )
    parser.add_argument(
        "--scenarios",
        metavar="LIST",
        help="comma-separated prefixes of the keys of the scenarios and floors to run: engine (vLLM's own engine, "
        "plugin off and on: a checkout of shmq only, see shmq_bench.engine), engine-mm (the same with images through "
        "vLLM's multimodal cache), engine-multinode (two nodes of this machine, faults beside vLLM alone), "
        "cross-language (Rust and Python writers "
        "and readers, each direction: a checkout and cargo), gpu (tensors received into device memory beside the "
        "pinned limit, and the encoder cache's IPC hand-off, one JSON line per row, see shmq_bench.gpu; on the CPU "
        "twin where torch sees no GPU), latency (latency_step, "
        "latency_remote), step_two_nodes (the executor's step to 1 local + 1 remote reader, beside vLLM's queue), "
        "throughput (1, 3), idle, fresh, loan, consume, tensor (the hand-over-only rows), e.g. "
        "fresh16_3 (16 MiB, 3 readers); floors: "
        + ", ".join(f.key for f in FLOORS)
        + ", or 'floors' for all of them; default: all",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="K",
        help="run every cell K times and show the median (default %(default)s)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds one run (one scenario, one transport, its processes' start included) takes at most on a quiet "
        "machine, tensor runs 120: a slower run keeps its figures, marked '(slow)' with a note under the table "
        "(default %(default)g)",
    )
    parser.add_argument(
        "--stall",
        type=float,
        default=STALL_S,
        metavar="S",
        help="seconds a run may go without progress (no message, barrier or process start in any of its processes) "
        "before it fails (default %(default)g)",
    )
    parser.add_argument(
        "--start-method",
        choices=("spawn", "forkserver"),
        help="how child processes start: spawn (the default preset's, the documented method) or forkserver "
        "(--quick's: a server that imported torch and vLLM once forks each child)",
    )
    parser.add_argument(
        "--gpu-sizes",
        metavar="LIST",
        help="comma-separated tensor sizes in MiB of --scenarios gpu (default: 16,256 on a GPU; 16 with --quick "
        "or on the CPU twin)",
    )
    parser.add_argument(
        "--mm-width",
        type=int,
        choices=(2048, 4096),
        default=2048,
        help="the width of the image embeddings of --scenarios engine-mm's random Llava: 2048 (2.3 MiB an image, "
        "the default) or 4096 (LLaVA-1.5-7B's, 4.5 MiB)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--no-progress", action="store_true", help="do not print the progress line")


def _own_tables(args: argparse.Namespace) -> list[tuple[str, Callable[[], int]]]:
    """The scenarios that print a table of their own, run (in this order) when named in
    ``--scenarios``: ``(key, run)``, ``run()`` returning an exit code. vLLM's engine on two
    nodes of this machine (:mod:`.multinode`), with images through its multimodal cache
    and plugin off and on (:mod:`.engine`), Rust and Python on either side of one queue
    (:mod:`.cross_language`)."""
    quick = args.preset == "quick"

    def multinode() -> int:
        from . import multinode

        return multinode.main(1 if quick else max(3, args.repeat))

    def engine_mm() -> int:
        from . import engine

        return engine.main_mm(1 if quick else max(3, args.repeat), args.mm_width)

    def engine() -> int:
        from . import engine

        return engine.main(max(3, args.repeat), quick)

    def cross_language() -> int:
        from . import cross_language

        return cross_language.main(args.repeat, quick)

    def gpu() -> int:
        from . import gpu

        sizes = [int(s) for s in args.gpu_sizes.split(",") if s.strip()] if args.gpu_sizes else None
        return gpu.main(sizes, quick)

    return [
        ("engine-multinode", multinode),
        ("engine-mm", engine_mm),
        ("engine", engine),
        ("cross-language", cross_language),
        ("gpu", gpu),
    ]


def main(args: argparse.Namespace) -> int:
    """``python -m shmq bench``: run, print the table; 1 if any run failed."""
    # vLLM's import pulls in `requests`, which warns about an optional dependency it
    # does not need here; keep the table clean (here and in the spawned processes).
    warnings.filterwarnings("ignore", module="requests")
    os.environ.setdefault("PYTHONWARNINGS", "ignore::Warning:requests")
    # torch logs deprecation warnings of its own modules that vLLM 0.33 imports; the
    # same: errors only, in every process.
    os.environ.setdefault("TORCH_LOGS", "-all")
    by_name = {t.name: t for t in TRANSPORTS}
    wanted = [n.strip() for n in args.transports.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by_name]
    if unknown or not wanted:
        print(f"unknown transport(s) {unknown}; choose from {', '.join(by_name)}", file=sys.stderr)
        return 2
    transports = [by_name[n] for n in wanted]
    base = PRESETS[args.preset]
    params = dataclasses.replace(
        base,
        rounds=args.rounds if args.rounds is not None else base.rounds,
        warmup=args.warmup if args.warmup is not None else base.warmup,
        objects=args.objects if args.objects is not None else base.objects,
        arrays=array_lib(),
        start_method=args.start_method or base.start_method,
    )
    only = [o.strip() for o in args.scenarios.split(",") if o.strip()] if args.scenarios else []
    for key, run_own_table in _own_tables(args):
        if key in only:
            code = run_own_table()
            only = [o for o in only if o != key]
            if not only:
                return code
    scenarios = selected(params, only)
    floors = selected_floors(only)
    if params.rounds < 1 or params.warmup < 0 or params.objects < 1 or args.repeat < 1:
        print("--rounds, --objects and --repeat must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    _context(params, transports, floors)  # a fork server starts importing meanwhile
    # Transports that cannot run here (vLLM not installed) are left out with a note,
    # unless they were asked for by name (their cells then say "skipped").
    left_out: dict[str, list[str]] = {}
    if args.transports == DEFAULT_TRANSPORTS:
        for t in list(transports):
            reason = t.unavailable()
            if reason is not None:
                transports.remove(t)
                left_out.setdefault(reason, []).append(t.name)
    if not transports and not floors:
        print("nothing to run: no transport can run here and no floor was chosen", file=sys.stderr)
        return 2

    machine = machine_info()
    print(_header(machine, params, args.repeat), flush=True)
    if params.arrays != "torch":
        print(f"note: the tensor rows send float32 numpy arrays ({TORCH_HINT} for torch tensors)", flush=True)
    for reason, names in left_out.items():
        print(f"note: {', '.join(names)} left out: {reason}", flush=True)
    for t in transports:
        if t.note:
            print(f"note: {t.name}: {t.note}", flush=True)

    cells = sum(1 for s in scenarios for t in transports if s.only is None or t.name in s.only)
    inline_floors = sum(len(s.floors) for s in scenarios)
    progress = Progress(cells + inline_floors + len(floors), enabled=not args.no_progress)
    details: list[str] = []
    started = time.monotonic()
    rows = run_bench(params, transports, args.timeout, args.repeat, progress, details, scenarios, floors, args.stall)
    wall = time.monotonic() - started

    print()
    print(format_table(rows, [t.name for t in transports]))
    skipped = skip_lines(rows, [t.name for t in transports])
    if skipped:
        print("\nskipped (not failures):")
        for line in skipped:
            print(f"  {line}")
    notes = note_lines(rows)
    if notes:
        print("\nslow (figures kept, not failures):")
        for line in notes:
            print(f"  {line}")
    failures = failure_lines(rows)
    if failures:
        print("\nfailed:")
        for failure in failures:
            print(f"  {failure}")
    print(f"\n(wall time {wall:.1f} s)")
    for text in details:
        print(f"\n{text}", file=sys.stderr)

    if args.json:
        doc = {
            "machine": machine,
            "params": {**dataclasses.asdict(params), "repeat": args.repeat},
            "queue": {"max_chunk_bytes": MAX_CHUNK_BYTES, "max_chunks": MAX_CHUNKS},
            "wall_s": wall,
            "rows": [dataclasses.asdict(row) for row in rows],
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return 1 if failures else 0


def skip_lines(rows: Sequence[Row], names: Sequence[str]) -> list[str]:
    """One line per reason a cell or row could not run here: what it needs, then which
    cells (a transport's whole column as ``<name> (every row)``) or rows."""
    by_reason: dict[str, list[str]] = {}
    for name in names:
        reasons = {row.skipped.get(name, "") for row in rows if name in row.values}
        if len(reasons) == 1 and "" not in reasons:  # the whole column, for one reason
            by_reason.setdefault(reasons.pop(), []).append(f"{name} (every row)")
            continue
        for row in rows:
            if name in row.skipped:
                by_reason.setdefault(row.skipped[name], []).append(f"{row.label} ({name})")
    # Floor rows: by name when one row of a floor is skipped, else counted per floor.
    floor_rows: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        if FLOOR_CELL in row.skipped:
            floor_rows.setdefault((row.skipped[FLOOR_CELL], row.group), []).append(row.label)
    for (reason, group), labels in floor_rows.items():
        what = labels[0] if len(labels) == 1 else f"{len(labels)} {group} rows"
        by_reason.setdefault(reason, []).append(what)
    return [f"{', '.join(dict.fromkeys(what))}: {reason}" for reason, what in by_reason.items()]


def note_lines(rows: Sequence[Row]) -> list[str]:
    """One line per noted cell (a slow run): the scenario, the transport and the note."""
    seen: dict[str, None] = {}
    for row in rows:
        for name, note in row.notes.items():
            seen.setdefault(f"{row.group} - {name}: {note}", None)
    return list(seen)


def failure_lines(rows: Sequence[Row]) -> list[str]:
    """One line per distinct failure: the transport (or floor row) and its error."""
    lines = [f"{name}: {err}" for row in rows for name, err in row.errors.items() if name != FLOOR_CELL]
    lines += [f"{row.label}: {row.errors[FLOOR_CELL]}" for row in rows if FLOOR_CELL in row.errors]
    return sorted(set(lines))
