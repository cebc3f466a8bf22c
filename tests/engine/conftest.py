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
