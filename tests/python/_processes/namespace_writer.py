"""The writer of a named queue in a pid namespace of its own, as in another container
sharing ``/dev/shm``: run as ``unshare --pid --fork --mount-proc python
namespace_writer.py NAME``. Prints ``ready <its pid there>``, waits for its reader, sends
one message, and shuts the queue down when a line comes on stdin (then prints
``ended``)."""

from __future__ import annotations

import os
import sys

from shmq import MessageQueue

MESSAGE = "from another pid namespace"


def main() -> None:
    mq = MessageQueue(1, 1, name=sys.argv[1])
    print("ready", os.getpid(), flush=True)
    mq.wait_until_ready(timeout=30)
    mq.enqueue(MESSAGE, timeout=30)
    sys.stdin.readline()
    mq.shutdown()
    print("ended", flush=True)


if __name__ == "__main__":
    main()
