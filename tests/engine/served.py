"""``vllm serve`` as the engine tests start it (one node, TP=2, the flags of
``shmq_bench.multinode``'s two-node runs), and what they ask of it; used by
``test_engine.py`` and by the session fixture of ``conftest.py``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from shmq_bench.engine import engine_env
from shmq_bench.multinode import ENGINE_FLAGS

ROOT = Path(__file__).resolve().parents[2]
DRIVER = str(ROOT / "tests" / "engine" / "driver.py")
ENGINE_START = 240.0  # an engine's start on 2 cores takes 30-60 s; a loaded CI more
#: The driver's prompts (``driver.py prompts``), which the two-node runs complete too.
PROMPTS = [f"the scheduler {i} sends a batch of tokens to the worker {i % 7}" for i in range(8)]


def env(plugin: bool) -> dict[str, str]:
    return engine_env(plugin, VLLM_LOGGING_LEVEL="INFO", PYTHONUNBUFFERED="1")


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A port for an engine's server, from 9000-11999: below the kernel's ephemeral range,
    where every outgoing connection takes its local port (port 0's answer could be taken
    by one before the server binds it); never the same twice in a session, and checked
    bindable without SO_REUSEADDR, so one left in TIME_WAIT is skipped."""
    start = 9000 + (os.getpid() * 7) % 3000
    for i in range(3000):
        port = 9000 + (start - 9000 + i) % 3000
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError("no free TCP port in 9000-11999")


def http(url: str, body: dict | None = None, timeout: float = 60.0) -> str:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read().decode()


class Server:
    """``vllm serve`` (through the driver) on 127.0.0.1, in its own process group."""

    def __init__(self, engine: tuple[str, str], plugin: bool, log: Path, model: str | None = None,
                 extra: tuple[str, ...] = (), wait: bool = True):
        python, self.model = engine
        self.model = model or self.model
        self.port = free_port()
        self.log_path = log
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [python, DRIVER, "serve", self.model, *ENGINE_FLAGS, "--host", "127.0.0.1", "--port", str(self.port),
             *extra],
            env=env(plugin),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Until its /health answers (the engine is up)."""
        deadline = time.monotonic() + ENGINE_START
        while True:
            assert self.proc.poll() is None, self.text()[-5000:]
            try:
                http(f"{self.url}/health", timeout=2)
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
        raw = http(f"{self.url}/v1/completions", body)
        if not stream:
            return json.loads(raw)["choices"][0]["text"]
        text = ""
        for line in raw.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
        return text

    def stop(self, sig: int, timeout: float = 120.0) -> int:
        # The whole engine at once for SIGKILL. A second stop (a test's `finally` after it
        # stopped the server itself) finds the group gone and the process reaped: nothing to do.
        try:
            if sig == signal.SIGKILL:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.send_signal(sig)
        except ProcessLookupError:
            pass
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


def completions(server: Server) -> list[str]:
    """The server's greedy completions of ``PROMPTS``, every other one streamed."""
    return [server.complete(p, stream=i % 2 == 1) for i, p in enumerate(PROMPTS)]
