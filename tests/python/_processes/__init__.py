"""Everything the Python tests run in other processes, and the tools to run it: the one
place for test helpers (``conftest.py`` holds only fixtures, and a child cannot import it).

Children are started with the multiprocessing "spawn" context, which pickles a child's
target by reference: every child entry point therefore lives at module level in this
package. A child reports to the test through a ``multiprocessing`` queue: one
``(tag, ...)`` tuple per report, or ``("error", pid, traceback)`` if it raised, so a
failure inside a child shows up in the test with the child's traceback instead of as a
bare exit code. Every blocking call a child makes has a timeout (``STEP``), so a broken
queue fails the test instead of hanging it.

The package, by what each file holds:

- ``harness``: running children (``Children``), waiting for a state (``wait_for``, the
  only polling loop of the tests; a queue side blocked in a call), the shmq segments in
  /dev/shm and who made them, processes still running. Standard library only, so that
  importing this package costs nothing.
- ``objects``: the test stream of objects.
- children of one test file or family each: ``arena_children``, ``encoder_cache_children``,
  ``fuzz_children``, ``group_children``, ``hostile_children``, ``liveness_children``,
  ``loan_seal_children``, ``metrics_children``, ``named_children``, ``queue_children``,
  ``remote_children``, ``store_children`` (also the store tests' serdes and exact
  comparison), ``store_view_children``, ``tensor_children``, ``vllm_children``,
  ``window_children``, ``worker_targets`` (functions ``WorkerProcesses`` runs);
- programs run by path (``python tests/python/_processes/NAME.py ...``, with
  ``tests/python`` on ``PYTHONPATH``): ``exit_leak_children``, ``hostile_peer``,
  ``relay_children`` (also spawned children), ``truncation_peer``, ``two_hosts``,
  ``worker_parent``;
- tools for such programs: ``private_shm`` (a program in a /dev/shm of its own),
  ``rust_examples`` (building the Rust examples).

``harness`` is imported here; the entry points of the first family's modules are found
by name on first use (``from _processes import store_writer``), importing only the module
that has it, so that a child or a program imports only what it runs.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from .harness import *  # noqa: F401,F403
from .harness import _SEGMENT_NAME  # noqa: F401

# Modules searched, in order, for a name this package does not have yet.
_ENTRY_POINT_MODULES = (
    "objects",
    "arena_children",
    "fuzz_children",
    "group_children",
    "hostile_children",
    "liveness_children",
    "metrics_children",
    "queue_children",
    "remote_children",
)


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    for module_name in _ENTRY_POINT_MODULES:
        module = importlib.import_module(f"{__name__}.{module_name}")
        if name in vars(module):
            value = vars(module)[name]
            globals()[name] = value
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
