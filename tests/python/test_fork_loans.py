"""A loan is private to the writer once sent, also against a child the writer forked
before the send (issue 32 item 4): the writer's arena data is not inherited through
``fork`` (``MADV_DONTFORK``), so such a child cannot write into what every reader's view
shows (it used to: its write after the send reached each reader, and the next loan).
A child that touches an inherited loan faults instead; one that does not is unaffected.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from _processes import STEP

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    import numpy as np
    from shmq import MessageQueue

    q = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=4)
    r = MessageQueue.create_from_handle(q.export_handle(), 0)
    loan = q.loan_array((1 << 19,), "float32")  # 2 MiB: sealed when sent (smaller loans are copied)
    loan[:] = 1.0
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.read(go_r, 1)          # after the parent's send
        loan[:] = 7.0             # the child's write into the inherited loan
        os._exit(0)
    q.enqueue(loan)
    view = r.dequeue(timeout=10)
    os.write(go_w, b"x")
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        print("CHILD signal", os.WTERMSIG(status))
    else:
        print("CHILD exit", os.WEXITSTATUS(status))
    print("VIEW", float(view.min()), float(view.max()))
    nxt = q.loan_array((1 << 19,), "float32")
    nxt[:] = 3.0
    q.enqueue(nxt)
    got = r.dequeue(timeout=10)
    print("NEXT", float(got.min()), float(got.max()))
    """
)


def test_a_child_forked_before_the_send_cannot_write_into_the_sent_loan(tmp_path):
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=STEP, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "VIEW 1.0 1.0" in p.stdout, p.stdout
    assert "NEXT 3.0 3.0" in p.stdout, p.stdout
    # The child had no mapping of the loan: its write faulted (SIGSEGV), it reached nobody.
    assert "CHILD signal 11" in p.stdout, p.stdout
