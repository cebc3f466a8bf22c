"""The soak (issue 18), short: ``scripts/soak.py`` with 20,000 messages instead of 10^6.

Four processes (the writer and three readers); small objects, arena-sized arrays (copied
and loaned) and messages larger than a chunk (over the local socket); reader 1 is
SIGKILLed partway and the queue (``on_dead_reader="drop"``) goes on without it. The
script checks everything itself and exits 1 on any failure; this test runs it as a
separate process and checks its JSON summary too: the other readers got every message
in order, the killed reader was dropped, the soak's ``/dev/shm`` segments and every
process's RSS did not grow beyond the script's bounds, and nothing was left in
``/dev/shm``. The run of 10^6 is by hand (docs/operations.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"
MESSAGES = 20_000
MiB = 1 << 20


@pytest.mark.timeout(150)
def test_soak_short():
    r = subprocess.run(
        [sys.executable, str(SOAK), "--messages", str(MESSAGES), "--seed", "7", "--progress", "5", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, f"soak failed (rc {r.returncode}):\n{r.stderr[-6000:]}"
    s = json.loads(r.stdout)
    print(f"\n{r.stderr.strip()}")
    assert s["ok"] and s["failures"] == [], s["failures"]
    assert s["messages"] == MESSAGES and s["readers"] == 3

    # The mix really was mixed, and large parts went through the arena.
    assert all(s["sent_by_kind"][k] > 0 for k in ("small", "arena", "loan", "over")), s["sent_by_kind"]
    assert s["arena"]["outstanding"] == 0, s["arena"]

    # Reader 1 was killed and dropped; the others got everything, in order, intact.
    killed = s["killed_rank"]
    assert 0 < s["killed_after"] < MESSAGES
    assert s["dropped_readers"] == [killed]
    survivors = {str(r) for r in range(s["readers"]) if r != killed}
    assert set(s["reports"]) == survivors
    for rank, report in s["reports"].items():
        assert report["received"] == MESSAGES, (rank, report)
        assert report["n_errors"] == 0 and report["errors"] == [], (rank, report["errors"])
        assert "exception" not in report, (rank, report)
        assert report["kinds"] == s["sent_by_kind"], (rank, report["kinds"])
        assert s["exit_codes"][rank] == 0
    assert s["exit_codes"][str(killed)] == -9

    # /dev/shm and RSS flat within the bounds; nothing left after shutdown.
    assert s["shm"]["own_growth_bytes"] <= s["bounds"]["shm_growth_mib"] * MiB, s["shm"]
    assert set(s["rss"]) == {"writer"} | {f"r{r}" for r in survivors}
    for name, rss in s["rss"].items():
        assert rss["growth"] is not None and rss["growth"] <= s["bounds"]["rss_growth_mib"] * MiB, (name, rss)
    assert s["shm"]["left_after_shutdown"] == []
