"""The encoder's side of the encoder-cache connector across nodes (``shmq._ec_remote``'s
``RemoteSender``), driven line by line on stdin by ``test_ec_remote.py``; run in a mount
namespace with a private ``/dev/shm`` where the test can make one (another node's).

    python ec_remote_sender.py HANDLE_FILE

Commands: ``save KEY FILL ROWS`` (a bfloat16 tensor ROWS x 64 of FILL; answers
``SAVED KEY True|False``), ``flush`` (``FLUSHED``), ``quit`` (``CLOSED``, then exits).
"""

from __future__ import annotations

import sys

import torch

from shmq._ec_remote import RemoteSender


def main() -> None:
    sender = RemoteSender(sys.argv[1], ip="127.0.0.1", timeout=10.0)
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "save":
            key, fill, rows = cmd[1], float(cmd[2]), int(cmd[3])
            value = torch.full((rows, 64), fill, dtype=torch.bfloat16)
            print(f"SAVED {key} {sender.save(key, value)}", flush=True)
        elif cmd[0] == "flush":
            sender.flush(30.0)
            print("FLUSHED", flush=True)
        elif cmd[0] == "quit":
            sender.close()
            print("CLOSED", flush=True)
            return


if __name__ == "__main__":
    main()
