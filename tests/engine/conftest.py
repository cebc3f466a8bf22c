"""The engine tests' shared fixture: vLLM's CPU build in its own venv (see test_engine.py)."""

from __future__ import annotations

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
