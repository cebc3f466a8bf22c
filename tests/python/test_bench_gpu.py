"""``python -m shmq bench --scenarios gpu`` on the CPU twin of the device seam: every row
of the scenario is printed, one JSON line each, with a positive figure, and says that it
is the twin's (protocol only, never a GPU figure). What is checked is that the rows run
end to end (the queue, the store and the encoder cache into "device memory", the limits
beside them), not how fast: the twin's copies are CPU copies. ``scripts/gpu_check.sh``
runs the same command on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shmq_bench.gpu import TWIN

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]

#: The rows of one size (1 MiB: the smallest the command takes), in the order printed.
ROWS = [
    "gpu.pinned1",
    "gpu.pageable1",
    "gpu.queue1_1",
    "gpu.queue1_4",
    "gpu.store1_1",
    "gpu.store1_4",
    "gpu.ec_roundtrip1",
    "gpu.ec_ipc1_1",
    "gpu.ec_ipc1_2",
]


def test_gpu_rows_run_on_the_twin_and_say_so() -> None:
    env = {**os.environ, "SHMQ_DEVICE": "twin"}
    cmd = [sys.executable, "-m", "shmq", "bench", "--scenarios", "gpu", "--gpu-sizes", "1"]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, f"exit code {out.returncode}\n{out.stdout}\n{out.stderr}"
    rows = [json.loads(line) for line in out.stdout.splitlines()]  # nothing but JSON lines
    assert [r["key"] for r in rows] == ROWS, out.stdout
    for r in rows:
        assert "error" not in r, r
        assert r["device"] == TWIN, r
        assert r["row"].endswith(f"[{TWIN}]"), r
        assert isinstance(r["value"], float) and r["value"] > 0, r
        # A target is never judged on the twin: its figures are not GPU figures.
        if "target" in r:
            assert r["met"] is None, r
    by_key = {r["key"]: r for r in rows}
    assert len(by_key["gpu.queue1_4"]["per_reader"]) == 4
    assert len(by_key["gpu.store1_4"]["per_reader"]) == 4
    assert by_key["gpu.ec_ipc1_2"]["roundtrip_over_ipc"] > 0
    assert "twin (CPU)" in out.stderr  # the header line, on stderr
