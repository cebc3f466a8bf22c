"""shmq's SIGBUS handler leaves a program's own handler working (issue 32 item 2).

A program with a C handler of its own for SIGBUS, installed before shmq's, that recovers
from faults in memory of its own (``csrc/own_sigbus.c``): shmq chains to it for every
fault that is not in a shmq mapping. It must work as it does without shmq when two
threads fault at once while the handler works (shmq's old loop guard sent the second one
to the default action: killed), and when it recovers with ``siglongjmp`` (the guard was
never reset: the second fault killed). A handler the program installs after shmq's stays
installed when shmq maps more segments (shmq used to put its own back over it).

Each case runs in a fresh interpreter (a fault that kills must not take pytest with it);
the C file is built with the machine's C compiler.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _processes import STEP

SOURCE = Path(__file__).resolve().parent / "csrc" / "own_sigbus.c"


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed to build the program's own handler (cc/gcc)"
    out = tmp_path_factory.mktemp("csrc") / "own_sigbus.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-pthread", "-o", str(out), str(SOURCE)], check=True, timeout=120)
    return str(out)


def _run(library: str, tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    script = textwrap.dedent(
        f"""
        import ctypes, sys
        lib = ctypes.CDLL({library!r})
        lib.current_sigbus_handler.restype = ctypes.c_size_t
        lib.install_over.restype = ctypes.c_size_t
        import shmq

        def make_queue():
            q = shmq.MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
            r = shmq.MessageQueue.create_from_handle(q.export_handle(), 0)
            q.wait_until_ready(10); r.wait_until_ready(10)
            q.enqueue(b"x"); assert r.dequeue(timeout=10) == b"x"
            return q, r
        """
    ) + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=STEP, cwd=tmp_path
    )


def test_the_programs_handler_recovers_faults_in_two_threads_at_once(library, tmp_path):
    p = _run(
        library,
        tmp_path,
        f"""
        assert lib.install_and_prepare({str(tmp_path / "region")!r}.encode(), 1 << 20, 0) == 0
        keep = make_queue()  # shmq's handler now, chaining to the program's
        for round in range(5):
            n = lib.fault_in_threads(4)
        print("RECOVERED", n)
        """,
    )
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    assert "RECOVERED 4" in p.stdout, p.stdout


def test_the_programs_handler_recovers_with_siglongjmp_again_and_again(library, tmp_path):
    p = _run(
        library,
        tmp_path,
        f"""
        assert lib.install_and_prepare({str(tmp_path / "region")!r}.encode(), 1 << 16, 1) == 0
        keep = make_queue()
        print("RECOVERED", lib.fault_with_longjmp(5))
        """,
    )
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    assert "RECOVERED 5" in p.stdout, p.stdout


def test_a_handler_installed_after_shmqs_stays(library, tmp_path):
    p = _run(
        library,
        tmp_path,
        """
        first = make_queue()  # shmq installs its handler
        mine = lib.install_over()
        more = [make_queue() for _ in range(3)]  # more segments mapped
        print("SAME", lib.current_sigbus_handler() == mine)
        """,
    )
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    assert "SAME True" in p.stdout, p.stdout
