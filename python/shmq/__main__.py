"""``python -m shmq COMMAND``: shmq's command line.

Each subcommand is an object (a module or a class) that provides
``add_arguments(parser)`` and ``main(args) -> exit code``; register it in
:data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional, Sequence

from . import admin, metrics, relay

#: What ``python -m shmq bench`` says (one line, exit status 1) where the bench is not
#: installed: it is a distribution of its own, shmq-bench, that shmq's wheel does not carry.
BENCH_MISSING = (
    "python -m shmq bench needs the bench, which shmq's [bench] extra installs: "
    "pip install 'shmq[bench]' (from a checkout of shmq: pip install '.[bench]' ./bench)"
)


def _bench() -> Any:
    """The bench (``shmq_bench``, the shmq-bench distribution), or None where it is not
    installed. Anything else its import raises (a broken install) is raised."""
    try:
        import shmq_bench
    except ModuleNotFoundError as e:
        if e.name != "shmq_bench":
            raise
        return None
    return shmq_bench


class BenchCommand:
    """``python -m shmq bench``: the bench's own command line (``shmq_bench``), or, where
    it is not installed, one line that says how to install it."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        bench = _bench()
        if bench is None:
            parser.description = BENCH_MISSING
            # Whatever follows is the bench's (--quick, --scenarios ...): main says what
            # is missing instead of argparse rejecting the options.
            parser.set_defaults(any_arguments=True)
            return
        # The description is the first paragraph of the bench's docstring.
        parser.description = (bench.__doc__ or "").strip().split("\n\n")[0]
        bench.add_arguments(parser)

    @staticmethod
    def main(args: argparse.Namespace) -> int:
        bench = _bench()
        if bench is None:
            print(BENCH_MISSING, file=sys.stderr)
            return 1
        return int(bench.main(args))


#: name -> (module with add_arguments/main, one-line help)
COMMANDS: dict[str, tuple[Any, str]] = {
    "bench": (BenchCommand, "latency and throughput of shmq's queue next to multiprocessing.Queue and pyzmq"),
    "cleanup": (admin.CleanupCommand, "remove segments left in /dev/shm by crashed processes"),
    "inspect": (admin.InspectCommand, "show a live queue's or store's state (or list all segments); --json: metrics"),
    "relay": (relay.RelayCommand, "serve this machine's readers of a remote queue with one stream (one copy per node)"),
    "top": (metrics.TopCommand, "a live table of every shmq queue, store and cache on this machine, with rates"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m shmq",
        description="shmq: shared-memory IPC for model-serving engines.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        # The description is the first paragraph of the module's docstring.
        description = (module.__doc__ or help_text).strip().split("\n\n")[0]
        sub = commands.add_parser(name, help=help_text, description=description)
        module.add_arguments(sub)
        sub.set_defaults(run=module.main)
    return parser


#: The exit status when whoever read the output stopped reading (``... | head -1``): what
#: a shell reports for a program killed by SIGPIPE (128 + 13), as ``cat`` would give.
EXIT_BROKEN_PIPE = 141


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        status = args.run(args)
        # Output still buffered fails here, not in the interpreter's exit (where it
        # would print "Exception ignored ... BrokenPipeError").
        sys.stdout.flush()
        return status
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of our output went away: stop quietly, as Python's docs advise
        # (library/signal.html, "Note on SIGPIPE"): what is left in stdout's buffer goes
        # to /dev/null so that the exit's flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


# Guarded: "spawn" children re-import this module as __mp_main__.
if __name__ == "__main__":
    sys.exit(main())
