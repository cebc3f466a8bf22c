"""The bench's harness bounds a run by its progress, not by its length: a run whose
processes keep making progress (each beats a shared counter as its messages go) is never
cut short, and one that takes longer than its expected time keeps its figures with a
note; a run in which no process makes progress for the watchdog's time fails, naming
who it waited for. Real processes (spawned), as the bench starts them."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any, Sequence

import pytest

pytestmark = pytest.mark.timeout(120)

pytest.importorskip("shmq_bench")


def _role_slow(transport: Any, channels: Sequence[Any], barrier: Any, *, steps: int, gap: float) -> int:
    """Slow but going: a beat every ``gap`` seconds, ``steps`` times."""
    from shmq_bench.roles import beat

    for _ in range(steps):
        time.sleep(gap)
        beat()
    return steps


def _role_stuck(transport: Any, channels: Sequence[Any], barrier: Any) -> int:
    """Started, then no progress at all."""
    time.sleep(60)
    return 0


def test_a_slow_run_that_makes_progress_keeps_its_figures_with_a_note(tmp_path: Path) -> None:
    from shmq_bench.harness import Harness, Job

    # 3 s in all, over the 0.5 s "timeout", each step well within the 2 s without progress.
    harness = Harness(multiprocessing.get_context("spawn"), str(tmp_path), timeout=0.5, stall=2.0)
    (value,) = harness.run(None, [Job(_role_slow, (), {"steps": 6, "gap": 0.5})])  # type: ignore[arg-type]
    assert value == 6
    (note,) = harness.take_notes()
    assert note.startswith("slow: a run took") and "figures kept" in note
    assert harness.take_notes() == []


def test_a_run_without_progress_fails_after_the_watchdogs_time(tmp_path: Path) -> None:
    from shmq_bench.common import BenchError
    from shmq_bench.harness import Harness, Job

    harness = Harness(multiprocessing.get_context("spawn"), str(tmp_path), timeout=600, stall=2.0)
    started = time.monotonic()
    with pytest.raises(BenchError, match=r"no progress for 2 s .* waiting for shmq-bench-role_stuck-0"):
        harness.run(None, [Job(_role_stuck, (), {})])  # type: ignore[arg-type]
    # Long before the run's 600 s or the role's 60 s (a bound, not a measurement).
    assert time.monotonic() - started < 45
