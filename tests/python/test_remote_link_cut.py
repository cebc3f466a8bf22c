"""A writer blocked on a remote reader's credit when the link between them is cut
(issue 44), between two network namespaces (the fixture of test_two_hosts.py): the
link goes down (``ip link set ... down``: no FIN, no RST, nothing more arrives) while
the writer waits for the reader, which is busy elsewhere, to take what was sent to it.

- Cut for 8 s, longer than the heartbeat bound (a PING every second, 4 s to hear from
  the reader: 5 s): the reader gives its connection up within the bound, and so does
  the writer: it counts the reader as gone (a warning naming its rank), its blocked
  enqueue returns within the bound of the cut, and later messages go on at once.
  Before, the writer went on waiting for that reader's credit after the link was back,
  until its enqueue's own timeout (30 s here; forever without one).
- Cut for 1.5 s, well within the bound: nothing is given up. The reader, once it reads
  (after the bound has passed), gets every message, and the writer's wait ends then.

Needs root, iproute2 and unshare (else skipped, as test_two_hosts.py);
test_remote_faults.py has the same over 127.0.0.1 with a stopped reader.
"""

from __future__ import annotations

import os
import time

import pytest

from _processes import wait_for_file
from _processes.two_hosts import BLOCKED_HWM, BLOCKED_TIMEOUT
from test_two_hosts import NS_A, NS_B, VETH_B, _results, _run, _start, two_hosts  # noqa: F401 (a fixture)

# The writer's heartbeat bound (docs/operations.md): a PING every second, the connection
# given up when nothing comes back for 4 s.
BOUND = 5.0
# Slack for a busy 2-core machine.
SLACK = 2.5


def _cut_and_collect(workdir: str, cut_s: float, read_after_s: float) -> tuple[dict, dict, float]:
    """Start the writer (host A) and the reader (host B); once the writer waits for the
    reader's credit, cut the link for ``cut_s`` seconds; let the reader read
    ``read_after_s`` seconds after the cut. The writer's and the reader's reports, and
    the wall-clock time of the cut."""
    procs = {
        "writer": _start(NS_A, "writer_blocked", workdir, own_shm=False),
        "reader": _start(NS_B, "remote_holding", workdir, own_shm=True),
    }
    try:
        wait_for_file(os.path.join(workdir, "full"), 60, "the writer to fill the reader's window", procs)
        # Not synchronisation: the writer's next enqueue is in its wait by then.
        time.sleep(0.5)
        cut_at = time.time()
        _run("ip", "-n", NS_B, "link", "set", VETH_B, "down")
        time.sleep(cut_s)
        _run("ip", "-n", NS_B, "link", "set", VETH_B, "up")
        time.sleep(max(0.0, cut_at + read_after_s - time.time()))
        with open(os.path.join(workdir, "read"), "w") as f:
            f.write("read")
    except BaseException:
        for p in procs.values():
            p.kill()
            p.wait(10)
        raise
    results = _results(procs)
    return results["writer"], results["reader"], cut_at


@pytest.mark.timeout(150)
def test_a_writer_blocked_on_a_reader_whose_link_is_cut_goes_on_without_it(two_hosts, tmp_path):  # noqa: F811
    w, r, cut_at = _cut_and_collect(str(tmp_path), cut_s=8.0, read_after_s=8.0)
    took = w["blocked_ended"] - cut_at
    # The writer counts the reader gone, and its blocked enqueue returns, within the
    # bound of the cut (not at its own timeout, BLOCKED_TIMEOUT)...
    assert w["blocked_error"] is None, (w["blocked_error"], f"{took:.2f} s after the cut")
    assert took < BOUND + SLACK, f"{took:.2f} s (its timeout: {BLOCKED_TIMEOUT} s)"
    # ... by the heartbeats' timeout (nothing heard from the reader for 4 s), not sooner.
    assert took > 3.0, f"{took:.2f} s"
    gone = [m for m in w["warnings"] if "remote reader rank 0" in m and "is gone" in m]
    assert gone, w["warnings"]
    assert "10.213.7.2" in gone[0], gone
    # Later messages go on at once (the gone reader holds nothing up).
    assert all(isinstance(t, float) and t < 1.0 for t in w["after"]), w["after"]
    # The reader, busy elsewhere meanwhile, gets what had arrived, then learns its
    # connection is gone.
    assert r["got"] == list(range(BLOCKED_HWM)), r
    assert r["error"][0] == "PeerDiedError" and "is gone" in r["error"][1], r["error"]


@pytest.mark.timeout(150)
def test_a_short_cut_loses_nothing_and_gives_no_reader_up(two_hosts, tmp_path):  # noqa: F811
    # The reader reads only once the bound has passed since the cut: the writer still
    # waits for it then (no false death), and its wait ends when the reader reads.
    read_after = BOUND + SLACK
    w, r, cut_at = _cut_and_collect(str(tmp_path), cut_s=1.5, read_after_s=read_after)
    assert w["blocked_error"] is None, w["blocked_error"]
    assert w["blocked_ended"] - cut_at > read_after, f"{w['blocked_ended'] - cut_at:.2f} s"
    assert not [m for m in w["warnings"] if "is gone" in m], w["warnings"]
    assert all(isinstance(t, float) for t in w["after"]), w["after"]
    assert r["got"] == list(range(BLOCKED_HWM + 4)), r
    assert r["error"][0] == "QueueShutDownError", r["error"]
