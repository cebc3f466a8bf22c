"""Running a test program in a private tmpfs ``/dev/shm`` of a chosen size, and what such a
program uses inside it (``test_small_shm.py``, ``test_encoder_cache_shm.py``,
``test_exit_leaks.py``).

The program runs in a mount namespace of its own (``unshare --mount``) whose
``/dev/shm`` is a fresh tmpfs, as a container with ``--shm-size`` has: what it creates
there cannot touch the machine's ``/dev/shm``, and whatever it leaves is visible to it
alone. It reports on its last stdout line, as JSON. Light on purpose (no torch, no
shmq): the programs import it inside the namespace too.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

# tests/python, where the program imports ``_processes`` from.
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def namespace_reason() -> str | None:
    """Why a private tmpfs /dev/shm cannot be made here, or None if it can."""
    try:
        r = subprocess.run(
            ["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
            capture_output=True,
            timeout=30,
        )
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        return f"unshare is not usable: {e}"
    if r.returncode != 0:
        return f"cannot mount a private /dev/shm (unshare --mount): {r.stderr.decode().strip()}"
    return None


def run_in_private_shm(program: str, args: list[str], shm_size: str, timeout: float) -> dict:
    """Run ``program`` (a Python file) with ``args`` in a private /dev/shm of ``shm_size``
    (``"64m"``); its last stdout line (JSON), once it exited 0. Skips the test, with the
    reason, where mount namespaces cannot be made."""
    reason = namespace_reason()
    if reason:
        pytest.skip(reason)
    command = " ".join([sys.executable, os.path.abspath(program), *args])
    script = f"mount -t tmpfs -o size={shm_size} tmpfs /dev/shm && exec {command}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, *sys.path]))
    p = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    # A SIGBUS would be -7 (or 135 from the shell): the one thing that must never happen.
    assert p.returncode == 0, f"program failed ({p.returncode}):\n{p.stderr[-4000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------
# Inside the program.


class ShmWarnings(logging.Handler):
    """The log records that say ``/dev/shm`` is too small (their texts, in order)."""

    def __init__(self, marker: str) -> None:
        super().__init__(logging.WARNING)
        self.marker = marker
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if self.marker in msg and "/dev/shm" in msg:
            self.texts.append(msg)


def capture_shm_warnings(marker: str = "is too small") -> ShmWarnings:
    """Start collecting the warnings that say ``/dev/shm`` is too small."""
    h = ShmWarnings(marker)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger().addHandler(h)
    return h


def shm_total() -> int:
    """Bytes of the tmpfs behind /dev/shm."""
    st = os.statvfs("/dev/shm")
    return st.f_blocks * st.f_frsize


def shm_free() -> int:
    """Bytes free in the tmpfs behind /dev/shm."""
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize
