"""What the Python tests run in other processes, and the tools to run it.

Children are started with the multiprocessing "spawn" context, which pickles a child's
target by reference: every child entry point therefore lives at module level here
(``conftest.py`` cannot be imported by a child). A child reports to the test through a
``multiprocessing`` queue: one ``(tag, ...)`` tuple per report, or
``("error", pid, traceback)`` if it raised, so a failure inside a child shows up in the
test with the child's traceback instead of as a bare exit code.

Every blocking call a child makes has a timeout (``STEP``), so a broken queue fails the
test instead of hanging it.

The package, by what each file holds: ``harness`` (running children, waiting for a
state with ``wait_for`` instead of sleeping, /dev/shm),
``objects`` (the test stream), ``arena_children``, ``queue_children``, ``liveness_children`` and
``group_children`` (the entry points of each test file's children).
``objects`` (the test stream), ``queue_children``, ``liveness_children`` and
``group_children``, ``remote_children`` (the entry points of each test file's children).
"""

from .arena_children import *  # noqa: F401,F403
from .fuzz_children import *  # noqa: F401,F403
from .group_children import *  # noqa: F401,F403
from .harness import *  # noqa: F401,F403
from .harness import _SEGMENT_NAME  # noqa: F401
from .hostile_children import *  # noqa: F401,F403
from .liveness_children import *  # noqa: F401,F403
from .objects import *  # noqa: F401,F403
from .metrics_children import *  # noqa: F401,F403
from .queue_children import *  # noqa: F401,F403
from .remote_children import *  # noqa: F401,F403
