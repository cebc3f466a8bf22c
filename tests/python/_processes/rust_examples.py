"""Building the crate's Rust examples and test binaries for the tests that run them
beside Python."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def build_example(name: str) -> str:
    """The path of the example ``name``, built with cargo (quick once ``cargo test`` built
    it; the first build may compile the crate's dependencies: minutes)."""
    return _build(["--example", name], name)


def build_test(package: str, name: str) -> str:
    """The path of the integration test binary ``name`` of workspace package
    ``package``, built with cargo (``cargo test --no-run``)."""
    return _build(["--tests", "-p", package], name, command="test", no_run=True)


def _build(args: list[str], name: str, command: str = "build", no_run: bool = False) -> str:
    if shutil.which("cargo") is None:
        pytest.skip("cargo is not on PATH: the Rust side of these tests cannot be built")
    build = subprocess.run(
        ["cargo", command, "--quiet", *(["--no-run"] if no_run else []), *args, "--message-format=json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert build.returncode == 0, build.stderr
    for line in build.stdout.splitlines():
        message = json.loads(line)
        if message.get("reason") == "compiler-artifact" and message["target"]["name"] == name:
            if message.get("executable"):
                return str(message["executable"])
    raise AssertionError(f"cargo built no {name} executable: {build.stdout[-2000:]}")
