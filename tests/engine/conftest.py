"""The engine tests' shared fixture: vLLM's CPU build in its own venv (see test_engine.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def engine() -> tuple[str, str]:
    """(the engine venv's python, the model directory), made by ``scripts/engine.sh``
    once per machine."""
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "engine.sh")], check=True, stdout=subprocess.PIPE, text=True, timeout=3000
    )
    return out.stdout.strip().splitlines()[-1], str(ROOT / "target" / "engine-model")


@pytest.fixture(scope="session")
def llama_served_alone(engine, tmp_path_factory) -> list[str]:
    """``vllm serve`` without the plugin, the Llama, on one node: its completions of
    ``served.PROMPTS``, which every served run with shmq must give, on one node
    (test_engine.py) and on two (test_multinode.py: vLLM alone on two nodes gives the
    very same texts, greedy with the same flags; one engine start serves both)."""
    import signal

    from served import PROMPTS, Server, completions

    server = Server(engine, False, tmp_path_factory.mktemp("serve") / "off.log")
    try:
        texts = completions(server)
        # Streamed and not: the same text for the same prompt.
        assert server.complete(PROMPTS[0], stream=True) == texts[0]
    finally:
        server.stop(signal.SIGTERM)
    return texts


# What vLLM's own processes leave in /dev/shm when a test kills them with their process
# group (its multiprocessing resource tracker included, which would have removed them),
# or kills one of its workers: its ``SharedMemory`` rings and semaphores, and its CPU
# all-reduce's segments. Not shmq's: the tests check those.
_VLLMS_LEFTOVERS = ("psm_", "sem.mp-", "vllm_dist_")


@pytest.fixture(scope="session", autouse=True)
def _vllms_leftovers_removed():
    """At the session's end, what vLLM's processes made in /dev/shm during it and left
    (``_VLLMS_LEFTOVERS``), removed unless a live process still maps or holds it: running
    the engine tests again and again does not fill /dev/shm with vLLM alone's rings."""
    before = set(os.listdir("/dev/shm"))
    yield
    left = [n for n in set(os.listdir("/dev/shm")) - before if n.startswith(_VLLMS_LEFTOVERS)]
    in_use = _dev_shm_in_use() if left else set()
    for name in left:
        if name not in in_use:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", name))


def _dev_shm_in_use() -> set[str]:
    """The /dev/shm names that some live process maps or has open."""
    names: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as maps:
                names.update(line.split("/dev/shm/", 1)[1].split()[0] for line in maps if "/dev/shm/" in line)
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("/dev/shm/"):
                        names.add(target[len("/dev/shm/"):].split()[0])
    return names
