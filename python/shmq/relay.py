"""One copy of a remote stream per node: ``python -m shmq relay`` runs a relay, a remote
reader of a queue that writes every message, whole, into a queue of its own whose readers
(on the relay's machine) read it through shared memory.

Without a relay, each remote reader is a stream of its own: a writer with 8 readers on
another machine sends every message 8 times over the network. With one relay per
machine it sends it once per machine; the relay copies it once into its ring, and its
local readers read it there as local readers of any queue do
(``MessageQueue.create_from_handle(relay.export_handle(), rank)``).

The relay passes messages on as they came (nothing is unpickled). Faults are peer deaths
on both sides: the writer sees a killed relay as a remote reader gone (a warning naming
its rank and host; no more messages go to it), the relay's readers see it as their
writer dead (``PeerDiedError``). The upstream writer's death (or its dropping the relay)
ends :meth:`Relay.run` with ``PeerDiedError`` / ``ConnectionError``; the command then
exits at once without shutting its queue down, so that its readers see their writer
die too. The upstream writer's shutdown shuts the relay's queue down after the same
messages (its readers get ``QueueShutDownError``), and the command exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Literal, Optional

from . import _cleanup, _core
from .message_queue import Handle

__all__ = ["Relay", "RelayCommand"]

#: The exit status of ``python -m shmq relay`` when its upstream writer died or dropped
#: it, or one of its readers died: the relay's queue is left without a shutdown.
EXIT_PEER_DIED = 3


class Relay:
    """A remote reader (rank ``rank`` of the queue of ``handle``) that passes every
    message on, whole, to ``n_local_reader`` readers on this machine through a queue of
    its own (see the module docs).

    ``local_reader_ranks`` names the local readers' ranks in the relay's queue (default
    ``0..n_local_reader``; the ranks they have in the whole job, say 8..15, read more
    clearly). The ring's sizes default to the upstream queue's where its handle has a
    ring, else the core's defaults; a message larger than a chunk goes over the relay's
    overflow socket, as in any queue. ``on_dead_reader``: ``"raise"`` (a dead local
    reader ends :meth:`run`, the default) or ``"drop"`` (the others go on). An option
    left ``None`` keeps the default (``shmq._core.QueueOptions``).
    """

    def __init__(
        self,
        handle: Handle,
        rank: int,
        n_local_reader: int,
        *,
        local_reader_ranks: Optional[list[int]] = None,
        max_chunk_bytes: Optional[int] = None,
        max_chunks: Optional[int] = None,
        on_dead_reader: Optional[Literal["raise", "drop"]] = None,
        spin_us: Optional[float] = None,
        yield_us: Optional[float] = None,
    ) -> None:
        options = _core.QueueOptions(
            local_reader_ranks=local_reader_ranks,
            max_chunk_bytes=max_chunk_bytes,
            max_chunks=max_chunks,
            on_dead_reader=on_dead_reader,
            spin_us=spin_us,
            yield_us=yield_us,
        )
        self._core = _core.Relay(str(handle), rank, n_local_reader, options)
        self.rank = rank
        # Shut down at exit; its segments removed by the janitor if the process dies.
        _cleanup.track_writer(self)

    def export_handle(self) -> Handle:
        """The handle of the relay's own queue, for its local readers."""
        return Handle.from_str(self._core.handle_text())

    def wait_until_ready(self, timeout: Optional[float] = None) -> None:
        """Wait for the local readers to join, then for the upstream writer to say start
        (``timeout`` seconds for both; ``TimeoutError`` after)."""
        self._core.wait_until_ready(timeout)

    def run(self) -> bool:
        """Pass messages on until the upstream writer shuts down (``True``; the relay's
        queue is shut down after the same messages) or :meth:`stop` is called
        (``False``). Raises ``PeerDiedError`` when the upstream writer dies or a local
        reader does (with ``on_dead_reader="raise"``), ``ConnectionError`` when the
        writer dropped the relay. Ctrl-C ends it with ``KeyboardInterrupt``; it may be
        called again after that."""
        return self._core.run()

    @property
    def forwarded(self) -> tuple[int, int]:
        """(messages, bytes) passed on so far."""
        return self._core.forwarded

    def stop(self) -> None:
        """End :meth:`run` from another thread (or a signal handler) and shut the relay's
        queue down."""
        self._core.stop()

    def close(self) -> None:
        """Shut the relay's queue down (its readers get ``QueueShutDownError`` after what
        was passed on) and leave the upstream stream."""
        self._core.close()

    def shutdown(self) -> None:
        """:meth:`close` (the name the exit hook calls)."""
        self.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        messages, nbytes = self.forwarded
        return f"<shmq.Relay rank {self.rank}: {messages} messages ({nbytes} bytes) passed on>"


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class RelayCommand:
    """Run a relay: one remote reader of a queue that serves the readers on this
    machine through a queue of its own (one copy of the stream per node)."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        src = parser.add_mutually_exclusive_group(required=True)
        src.add_argument("--handle", help="the upstream queue's handle, as str(handle) prints it")
        src.add_argument("--handle-file", help="a file holding the upstream handle's text (waited for)")
        parser.add_argument("--rank", type=int, required=True, help="the relay's rank in the upstream queue")
        parser.add_argument("--local-readers", type=int, required=True, help="readers on this machine")
        parser.add_argument(
            "--local-ranks",
            help="their ranks in the relay's queue, comma-separated (default 0..N-1)",
        )
        parser.add_argument("--out", help="write the relay's handle here (atomically); it is also printed")
        parser.add_argument("--max-chunk-bytes", type=int, help="default: the upstream queue's")
        parser.add_argument("--max-chunks", type=int, help="default: the upstream queue's")
        parser.add_argument("--on-dead-reader", choices=["raise", "drop"])
        parser.add_argument(
            "--timeout", type=float, default=300.0, help="seconds to wait for the handle file and for readiness"
        )

    @staticmethod
    def main(args: argparse.Namespace) -> int:
        text = args.handle
        if text is None:
            deadline = time.monotonic() + args.timeout
            while not os.path.exists(args.handle_file):
                if time.monotonic() > deadline:
                    print(f"no handle in {args.handle_file} after {args.timeout} s", file=sys.stderr)
                    return 1
                time.sleep(0.05)
            with open(args.handle_file) as f:
                text = f.read().strip()
        ranks = [int(r) for r in args.local_ranks.split(",")] if args.local_ranks else None
        relay = Relay(
            Handle.from_str(text),
            args.rank,
            args.local_readers,
            local_reader_ranks=ranks,
            max_chunk_bytes=args.max_chunk_bytes,
            max_chunks=args.max_chunks,
            on_dead_reader=args.on_dead_reader,
        )
        own = str(relay.export_handle())
        if args.out:
            _write_atomically(args.out, own)
        print(own, flush=True)
        try:
            relay.wait_until_ready(args.timeout)
            ended = relay.run()
        except (_core.PeerDiedError, ConnectionError) as e:
            # Leave the queue as a dead writer leaves it: its readers see a death, not a
            # shutdown. The janitor removes its segments.
            print(f"shmq relay: {type(e).__name__}: {e}; exiting (status {EXIT_PEER_DIED})", file=sys.stderr)
            sys.stderr.flush()
            os._exit(EXIT_PEER_DIED)
        messages, nbytes = relay.forwarded
        how = "the upstream writer shut down" if ended else "stopped"
        print(f"shmq relay: {how}; {messages} messages ({nbytes} bytes) passed on", file=sys.stderr)
        relay.close()
        return 0
