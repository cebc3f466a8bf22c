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

from . import admin, bench, metrics, relay

#: name -> (module with add_arguments/main, one-line help)
COMMANDS: dict[str, tuple[Any, str]] = {
    "bench": (bench, "latency and throughput of shmq's queue next to multiprocessing.Queue and pyzmq"),
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
    args = parser.parse_args(argv)
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
