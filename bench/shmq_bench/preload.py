"""What the fork server imports before it forks the benchmark's child processes (the
``forkserver`` start method, ``--quick``'s): the modules named in the environment
variable ``SHMQ_BENCH_PRELOAD`` (comma-separated), each only if it imports at all, so
that a broken optional dependency (a vLLM whose import raises something other than
``ImportError``) leaves the server running; its rows then fail on their own.

Importing torch and vLLM once there, instead of in every child, is what makes a child
start in milliseconds rather than seconds. This module is imported only by that server.
"""

from __future__ import annotations

import importlib
import os

#: The environment variable that names the modules.
ENV = "SHMQ_BENCH_PRELOAD"

for _name in filter(None, os.environ.get(ENV, "").split(",")):
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001, S112 - a child that needs it will say why it failed
        pass
