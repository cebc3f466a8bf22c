"""Drive vLLM's own engine (its CPU build) for the engine tests and the engine bench.

Runs in the engine venv that ``scripts/engine.sh`` makes, never in shmq's test venv. The
plugin is on when ``SHMQ_VLLM=1`` is in the environment (the caller decides). Each
command prints one line ``RESULT <json>`` at the end; the caller reads nothing else.

    python driver.py offline MODEL [--prompts N] [--max-tokens N] [--end scope|shutdown]
                                   [--reps N]
    python driver.py worker-death MODEL [--when idle|generating]
    python driver.py sparse MODEL [--seconds S] [--every S]
    python driver.py mm LLAVA [--cache shm|lru] [--cache-mib M] [--sequence 0,0,1,...]
                              [--end scope|shutdown]
    python driver.py epd LLAVA --role ec_producer|ec_consumer|ec_both|none [--name NAME]
                              [--connector shmq|example] [--storage DIR]
                              [--remote-handle-file FILE [--remote-ip IP]]
    python driver.py multinode MODEL --master-port P [--fault-window S]
    python driver.py serve MODEL [vllm serve's arguments...]

Every engine is TP=2 on the mp executor with ``enforce_eager``; the environment brings
``VLLM_CPU_OMP_THREADS_BIND="0|1"`` and ``VLLM_CPU_KVCACHE_SPACE=1``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import threading
import time

ENGINE_ARGS = dict(
    tensor_parallel_size=2,
    distributed_executor_backend="mp",
    enforce_eager=True,
    max_model_len=512,
    max_num_seqs=64,
    dtype="bfloat16",
    seed=0,
)


PROFILE_ENV = "SHMQ_ENGINE_PROFILE"


def _profile_queues(out_dir: str) -> None:
    """In every engine process (vLLM spawns them, and each imports this file as
    ``__mp_main__``): time the queue calls of vLLM's class and of shmq's (whichever the
    plugin left in place), in the calling thread's CPU time (a spin is CPU too) and in
    wall time, and write the totals to ``out_dir/<pid>.json`` every 64 calls."""
    import atexit
    import functools

    stats: dict[str, list[float]] = {}
    calls: dict[str, list[tuple[float, float]]] = {}

    def dump() -> None:
        try:
            import setproctitle

            title = setproctitle.getproctitle()
        except Exception:
            title = "?"
        with open(os.path.join(out_dir, f"{os.getpid()}.json"), "w") as f:
            json.dump({"title": title, "stats": stats, "calls": calls}, f)

    def wrap(cls: type, name: str, key: str, every: int = 64, each: bool = False, finish=None) -> None:
        """``finish(before, self, *args, **kwargs)``, if given, runs inside the timer after
        the call (``before``: what ``finish.before(self, *args, **kwargs)`` returned before
        it): the work the call leaves for later, done there so that the row includes it."""
        original = getattr(cls, name)
        if getattr(original, "_profiled", False):
            return

        @functools.wraps(original)
        def timed(*args, **kwargs):
            c0, w0, p0 = time.thread_time(), time.perf_counter(), time.process_time()
            try:
                before = finish.before(*args, **kwargs) if finish is not None else None
                result = original(*args, **kwargs)
                if finish is not None:
                    finish(before, *args, **kwargs)
                return result
            finally:
                s = stats.setdefault(key, [0, 0.0, 0.0, 0.0])
                s[0] += 1
                s[1] += time.thread_time() - c0
                s[2] += time.perf_counter() - w0
                s[3] += time.process_time() - p0  # every thread of the process (a copier's too)
                if each:  # rare calls (a save per item): each one's (CPU, wall, process CPU) too
                    calls.setdefault(key, []).append(
                        (time.thread_time() - c0, time.perf_counter() - w0, time.process_time() - p0)
                    )
                if s[0] % every == 0:
                    dump()

        timed._profiled = True  # type: ignore[attr-defined]
        setattr(cls, name, timed)

    import shmq
    from vllm.distributed.device_communicators import shm_broadcast

    for cls, tag in ((shm_broadcast.MessageQueue, "vllm"), (shmq.MessageQueue, "shmq")):
        wrap(cls, "enqueue", f"{tag}.enqueue")
        wrap(cls, "dequeue", f"{tag}.dequeue")
    # The encoder-cache connectors' hand-off: the encoder's saves, the prefill/decode
    # workers' loads (called every step, an item or not); written at every call.
    try:
        from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

        from shmq.vllm_ec_connector import ShmqECConnector
    except ImportError:  # a vLLM without EC connectors
        pass
    else:
        for cls, tag in ((ECExampleConnector, "ec.example"), (ShmqECConnector, "ec.shmq")):
            # The save row runs until the item is visible to a consumer (shmq's copy runs
            # on a thread of its own after save_caches returns: waited for in the row);
            # ECExampleConnector's file is written inside the call.
            saved = _until_published if cls is ShmqECConnector else None
            wrap(cls, "save_caches", f"{tag}.save", every=1, each=True, finish=saved)
            # The load row runs until every byte loaded was read (shmq's are views whose
            # pages are first read later in the step): the same read for both.
            wrap(cls, "start_load_caches", f"{tag}.load", every=1, finish=_read_every_loaded_byte)
    atexit.register(dump)


def _until_published(_before, connector, *args, **kwargs) -> None:
    """After shmq's ``save_caches``: wait until the item is published (its copy done)."""
    connector.wait_for_save()


_until_published.before = lambda *args, **kwargs: None  # type: ignore[attr-defined]


def _encoder_cache_arg(args, kwargs) -> dict:
    """vLLM's encoder cache, as ``start_load_caches`` was given it."""
    return kwargs["encoder_cache"] if "encoder_cache" in kwargs else args[0]


def _read_every_loaded_byte(before, connector, *args, **kwargs) -> None:
    """After a ``start_load_caches``: read every byte of the items it added to vLLM's
    encoder cache (a sum over each tensor, as the model's first use of it would read it)."""
    import torch

    encoder_cache = _encoder_cache_arg(args, kwargs)
    for key in set(encoder_cache) - before:
        value = encoder_cache[key]
        for t in value.values() if isinstance(value, dict) else [value]:
            if isinstance(t, torch.Tensor):
                t.sum(dtype=torch.float32).item()


_read_every_loaded_byte.before = lambda connector, *a, **k: set(_encoder_cache_arg(a, k))  # type: ignore[attr-defined]


if os.environ.get(PROFILE_ENV):
    _profile_queues(os.environ[PROFILE_ENV])


def prompts(n: int) -> list[str]:
    return [f"the scheduler {i} sends a batch of tokens to the worker {i % 7}" for i in range(n)]


#: The sizes of the test images, by ``i % 4``: small ones for the tests' tiny Llava (its
#: processor resizes them to 32x32), real ones with ``SHMQ_ENGINE_IMAGE_SIZES=real`` (the
#: bench's real-sized Llava, whose processor resizes them to 336x336).
IMAGE_SIZES = ((32, 32), (48, 40), (64, 64), (40, 56))
REAL_IMAGE_SIZES = ((336, 336), (640, 480), (1024, 768), (480, 640))


def image(i: int, size: tuple[int, int] | None = None):
    """Test image ``i``: a deterministic pattern; its size varies with ``i`` (see
    ``IMAGE_SIZES``)."""
    import numpy as np
    from PIL import Image

    sizes = REAL_IMAGE_SIZES if os.environ.get("SHMQ_ENGINE_IMAGE_SIZES") == "real" else IMAGE_SIZES
    w, h = size or sizes[i % 4]
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([(x * (i + 3) + y * 7) % 256, (y * (i + 5) + 31 * i) % 256, (x * y + 17 * i) % 256], -1)
    return Image.fromarray(rgb.astype(np.uint8), "RGB")


def image_data_url(i: int) -> str:
    """Image ``i`` as a ``data:`` URL (PNG), as a client sends it to ``vllm serve``."""
    import base64
    import io

    buf = io.BytesIO()
    image(i).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def mm_prompt(i: int, images: int = 1) -> str:
    """The Llava prompt for request ``i`` (with ``images`` images)."""
    return f"<|user|>{'<image>' * images}what is in picture {i % 5}\n<|assistant|>"


def vllm_store_names() -> list[str]:
    """vLLM's multimodal stores in /dev/shm (``vllm_mm_<id>``)."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("vllm_mm_"))


def shm_names(pids: set[int] | None = None) -> list[str]:
    """shmq's files in /dev/shm; only those made by ``pids`` when given (a name carries its
    creator's pid: ``shmq_<kind>_<pid>_<hex>``), so that other programs' do not count."""
    names = []
    for n in os.listdir("/dev/shm"):
        parts = n.split("_")
        if not n.startswith("shmq_"):
            continue
        if pids is None or (len(parts) >= 4 and parts[2].isdigit() and int(parts[2]) in pids):
            names.append(n)
    return sorted(names)


def our_pids() -> set[int]:
    """This process and the engine's."""
    return {os.getpid(), *engine_processes()}


def engine_processes() -> list[int]:
    """Live processes of vLLM's engine on this machine (its titles: VLLM::...)."""
    import psutil

    out = []
    for p in psutil.process_iter(["name", "status"]):
        try:
            if (p.info["name"] or "").startswith("VLLM::") and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


def workers() -> list[int]:
    import psutil

    return sorted(
        p.pid for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith("VLLM::Worker")
    )


def plugin_active() -> bool:
    try:
        import shmq.vllm_plugin as plugin
    except ImportError:
        return False
    return plugin.is_active()


def sampling(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def time_per_output_token(llm, prompt: str, reps: int) -> list[float]:
    """One request alone, 64 tokens, ``reps`` times: seconds per output token (its decode
    steps are the step broadcast's path)."""
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        single = llm.generate([prompt], sampling(64), use_tqdm=False)
        out.append((time.perf_counter() - t) / max(1, len(single[0].outputs[0].token_ids)))
    return out


def result(payload: dict) -> None:
    print("RESULT " + json.dumps(payload), flush=True)


def cmd_offline(args: argparse.Namespace) -> None:
    from vllm import LLM

    if args.profile:
        import tempfile

        os.environ[PROFILE_ENV] = tempfile.mkdtemp(prefix="shmq-engine-profile-")
    t0 = time.perf_counter()
    llm = LLM(model=args.model, **ENGINE_ARGS)
    started = time.perf_counter() - t0
    ps = prompts(args.prompts)
    params = sampling(args.max_tokens)
    outputs = None
    batch_tps = []
    for _ in range(args.reps):
        t = time.perf_counter()
        outputs = llm.generate(ps, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        batch_tps.append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
    tpot = time_per_output_token(llm, ps[0], args.reps)
    assert outputs is not None
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    pids = our_pids()
    live = {"shm_while_running": shm_names(pids), "plugin": plugin_active()}
    if args.end == "shutdown":
        llm.llm_engine.engine_core.shutdown()
    del llm, outputs
    gc.collect()
    # The engine's processes are gone (or going): what they made must go with them.
    deadline = time.monotonic() + 15
    while (engine_processes() or shm_names(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    queue_profile = _read_profile(os.environ.get(PROFILE_ENV)) if args.profile else None
    result(
        dict(
            live,
            queue_profile=queue_profile,
            start_s=started,
            tokens=tokens,
            batch_tokens_per_s=batch_tps,
            time_per_output_token_s=tpot,
            shm_after=shm_names(pids),
            engine_processes_after=engine_processes(),
        )
    )


def _read_profile(out_dir: str | None) -> dict[str, dict[str, list[float]]]:
    """The engine processes' queue-call totals, by process title."""
    got: dict[str, dict[str, list[float]]] = {}
    if not out_dir:
        return got
    for name in os.listdir(out_dir):
        with open(os.path.join(out_dir, name)) as f:
            entry = json.load(f)
        if entry["stats"]:
            got[f"{entry['title']} ({name.split('.')[0]})"] = entry["stats"]
    return got


def cmd_mm(args: argparse.Namespace) -> None:
    """Image prompts through vLLM's multimodal processor cache (``--cache shm``: the
    front end writes each item once into the shared-memory store, every worker reads it
    from there; ``lru``: items go with the requests). ``--sequence`` lists the image of
    each request (``0,0,1,...``); the requests go one at a time, so that each is a cache
    hit or miss of its own, read from vLLM's own counters: a repeated image is a hit
    unless the cache evicted it meanwhile. Reports the greedy tokens, the hits, and what
    is in /dev/shm while the engine runs and once it is gone (``--end``). A request of
    several images lists them with ``+`` (``0+1+2+3``); its hits are then counted.
    ``--then-kill-worker idle|generating``: the ``worker-death --images`` run follows on
    the same engine (its ``error``, ``error_after_s``, ``hung``), instead of a normal end.
    ``--concurrent N``: then N one-image requests at once, twice (``concurrent``)."""
    from vllm import LLM

    t0 = time.perf_counter()
    shm_only = {"mm_shm_cache_max_object_size_mb": 1} if args.cache == "shm" else {}
    if args.ec_both:  # also shmq's encoder-cache connector, saving and loading (ec_both)
        from vllm.config import ECTransferConfig

        shm_only["ec_transfer_config"] = ECTransferConfig(
            ec_role="ec_both", ec_connector="ShmqECConnector", ec_connector_module_path="shmq.vllm_ec_connector",
            ec_connector_extra_config={"name": args.ec_both})
    llm = LLM(
        model=args.model,
        mm_processor_cache_type=args.cache,
        mm_processor_cache_gb=args.cache_mib / 1024,
        limit_mm_per_prompt={"image": max(len(g.split("+")) for g in args.sequence.split(","))},
        **shm_only,
        **dict(ENGINE_ARGS, max_model_len=args.max_model_len),
    )
    started = time.perf_counter() - t0
    store_name = os.environ.get("VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME")
    cache = llm.llm_engine.renderer.mm_processor_cache
    sequence = [[int(i) for i in group.split("+")] for group in args.sequence.split(",")]
    tokens = []
    texts = []
    hits: list = []
    request_s = []
    for n, group in enumerate(sequence):
        before = cache.make_stats().hits if cache is not None else 0
        images = [image(i) for i in group]
        t = time.perf_counter()
        request = {"prompt": mm_prompt(n, len(group)), "multi_modal_data": {"image": images[0] if len(group) == 1
                                                                             else images}}
        out = llm.generate([request], sampling(args.max_tokens), use_tqdm=False)[0]
        request_s.append(time.perf_counter() - t)
        tokens.append(list(out.outputs[0].token_ids))
        texts.append(out.outputs[0].text)
        got = cache.make_stats().hits - before if cache is not None else 0
        hits.append(got > 0 if len(group) == 1 else got)
    concurrent = {phase: _concurrent_images(llm, args.concurrent, phase) for phase in ("fresh", "again")
                  } if args.concurrent else {}
    info = cache.make_stats() if cache is not None else None
    pids = our_pids()
    live = dict(
        concurrent=concurrent,
        plugin=plugin_active(),
        store_class=(type(cache._shm_cache).__module__ + "." + type(cache._shm_cache).__qualname__)
        if cache is not None and hasattr(cache, "_shm_cache")
        else None,
        store_name=store_name,
        vllm_stores_while_running=vllm_store_names(),
        shm_while_running=shm_names(pids),
        hits=hits,
        texts=texts,
        cache_hits=info.hits if info is not None else None,
        cache_queries=info.total if info is not None else None,
        cache_class=type(cache).__name__ if cache is not None else None,
    )
    killed = {}
    if args.then_kill_worker:  # the worker-death run on this engine, instead of a normal end
        killed = kill_a_worker(llm, args.then_kill_worker, True, 60.0)
    elif args.end == "shutdown":
        llm.llm_engine.engine_core.shutdown()
    del llm, cache
    gc.collect()
    deadline = time.monotonic() + 15
    while (engine_processes() or shm_names(pids) or vllm_store_names()) and time.monotonic() < deadline:
        time.sleep(0.1)
    result(
        dict(
            live,
            **killed,
            tokens=tokens,
            start_s=started,
            request_s=request_s,
            shm_after=shm_names(pids),
            vllm_stores_after=vllm_store_names(),
            engine_processes_after=engine_processes(),
        )
    )


def _concurrent_images(llm, n: int, phase: str) -> dict:
    """``n`` requests of one image each submitted at once (``fresh``: images no request
    had before; ``again``: the same ones, now in the cache), one output token each:
    the seconds from the submission to each request's first token, and to the last."""
    engine = llm.llm_engine
    t0 = time.perf_counter()
    for k in range(n):
        request = {"prompt": mm_prompt(k), "multi_modal_data": {"image": image(1000 + k)}}
        engine.add_request(f"concurrent-{phase}-{k}", request, sampling(1))
    first: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
    return {"wall_s": time.perf_counter() - t0, "ttft_s": sorted(first.values()), "requests": len(first)}


def cmd_epd(args: argparse.Namespace) -> None:
    """One instance of a disaggregated-encoding deployment (offline ``LLM``), driven by
    the caller as vLLM's EPD proxy drives its instances: one JSON request a line on
    stdin (``{"n": ..., "image": i, "uuid": ..., "max_tokens": k}``), one ``OUT <json>``
    line back (the text, the tokens, the seconds it took). ``--role``: the EC role
    (``none``: an ordinary instance); ``--connector``: shmq's (``ShmqECConnector``, the
    cache named ``--name``) or vLLM's own ``ECExampleConnector`` (a file per item under
    ``--storage``). ``READY`` once the engine is up; ``quit`` ends it (a ``RESULT`` line
    with what is left in /dev/shm)."""
    from vllm import LLM

    extra: dict = {}
    if args.role != "none":
        from vllm.config import ECTransferConfig

        if args.connector == "shmq":
            shmq_config: dict = {"name": args.name}
            if args.remote_handle_file:
                shmq_config["remote_handle_file"] = args.remote_handle_file
            if args.remote_ip:
                shmq_config["remote_ip"] = args.remote_ip
            connector = dict(ec_connector="ShmqECConnector", ec_connector_module_path="shmq.vllm_ec_connector",
                             ec_connector_extra_config=shmq_config)
        else:
            connector = dict(ec_connector="ECExampleConnector",
                             ec_connector_extra_config={"shared_storage_path": args.storage})
        extra["ec_transfer_config"] = ECTransferConfig(ec_role=args.role, **connector)
    llm = LLM(model=args.model, limit_mm_per_prompt={"image": 1}, **dict(ENGINE_ARGS, max_model_len=args.max_model_len),
              **extra)
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        req = json.loads(line)
        request = {
            "prompt": mm_prompt(req["n"]),
            "multi_modal_data": {"image": image(req["image"])},
            "multi_modal_uuids": {"image": [req["uuid"]]},
        }
        t = time.perf_counter()
        out = llm.generate([request], sampling(req.get("max_tokens", 8)), use_tqdm=False)[0]
        elapsed = time.perf_counter() - t
        reply = dict(n=req["n"], text=out.outputs[0].text, tokens=list(out.outputs[0].token_ids), seconds=elapsed,
                     ec_transfer_params=getattr(out, "ec_transfer_params", None))
        print("OUT " + json.dumps(reply, default=str), flush=True)
    pids = our_pids()
    del llm
    gc.collect()
    deadline = time.monotonic() + 15
    while (engine_processes() or shm_names(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    result(dict(plugin=plugin_active(), shm_after=shm_names(pids), engine_processes_after=engine_processes()))


def cmd_worker_death(args: argparse.Namespace) -> None:
    """SIGKILL one TP worker (idle, or while a generate runs) and time the caller's error.
    ``--images``: the model is the Llava, and the requests carry images through vLLM's
    multimodal cache in shared memory (``mm_processor_cache_type="shm"``, the store
    shmq's with the plugin), so the worker dies while it reads them. Text: the greedy
    tokens of the ``offline`` command's prompts come first (``tokens``)."""
    from vllm import LLM

    tokens = None
    if args.images:
        llm = LLM(model=args.model, mm_processor_cache_type="shm", mm_processor_cache_gb=0.02 / 1024,
                  mm_shm_cache_max_object_size_mb=1, limit_mm_per_prompt={"image": 1},
                  **dict(ENGINE_ARGS, max_model_len=256))
        llm.generate(image_batch(2), sampling(4), use_tqdm=False)
    else:
        llm = LLM(model=args.model, **ENGINE_ARGS)
        outputs = llm.generate(prompts(32), sampling(16), use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        del outputs
    pids = our_pids()
    killed = kill_a_worker(llm, args.when, args.images, args.limit)
    del llm
    gc.collect()
    result(dict(killed, **ended(pids), tokens=tokens))


def image_batch(n: int) -> list:
    """``n`` requests with an image each (six images in turn)."""
    return [{"prompt": mm_prompt(k), "multi_modal_data": {"image": image(k % 6)}} for k in range(n)]


def kill_a_worker(llm, when: str, images: bool, limit: float) -> dict:
    """One TP worker of the started engine ``llm`` SIGKILLed, idle or while a generate
    runs (with ``images``: ``image_batch`` requests), and what the caller saw: its error
    and how long after the kill. (``worker-death``; ``mm --then-kill-worker``.)"""
    batch = image_batch if images else prompts
    victims = workers()
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(victims[-1], signal.SIGKILL)

    outcome = {"error": None}
    done = threading.Event()

    def watchdog() -> None:
        if not done.wait(limit):
            # A hang: report it and leave (the caller kills what is left of the engine).
            result(dict(outcome, hung=True, seconds=limit, plugin=plugin_active()))
            os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    if when == "idle":
        kill()
        time.sleep(0.5)
    else:
        threading.Timer(1.0, kill).start()
    try:
        while True:
            llm.generate(batch(64), sampling(128), use_tqdm=False)
            if not killed_at:
                continue
            if time.monotonic() - killed_at[0] > limit:
                break
    except Exception as e:  # vLLM's EngineDeadError (or what it raises instead)
        outcome["error"] = f"{type(e).__name__}: {e}"[:300]
    error_after = time.monotonic() - killed_at[0]
    done.set()
    return dict(outcome, hung=False, error_after_s=error_after, plugin=plugin_active())


def ended(pids: set[int]) -> dict:
    """Once the caller has let its engine go: the engine's processes and what ``pids``
    made in /dev/shm, each waited for (20 s at most) to be gone."""
    deadline = time.monotonic() + 20
    while (engine_processes() or shm_names(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return dict(engine_processes_after=engine_processes(), shm_after=shm_names(pids))


def cmd_sparse(args: argparse.Namespace) -> None:
    """One short request every ``every`` seconds for ``seconds``: the workers' CPU time."""
    import psutil
    from vllm import LLM

    llm = LLM(model=args.model, **ENGINE_ARGS)
    llm.generate(prompts(2), sampling(8), use_tqdm=False)
    procs = [psutil.Process(pid) for pid in workers()]

    def cpu() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in procs)

    time.sleep(2.0)  # past vLLM's 1 s spin after the warm-up
    before = cpu()
    n = 0
    t_end = time.monotonic() + args.seconds
    while time.monotonic() < t_end:
        t = time.monotonic()
        llm.generate(prompts(1), sampling(8), use_tqdm=False)
        n += 1
        time.sleep(max(0.0, args.every - (time.monotonic() - t)))
    used = cpu() - before
    idle_before = cpu()
    time.sleep(args.idle)
    idle = cpu() - idle_before
    result(
        dict(
            requests=n,
            worker_cpu_s=used,
            worker_cpu_s_per_request=used / max(1, n),
            idle_worker_cpu_percent=100.0 * idle / args.idle / max(1, len(procs)),
            plugin=plugin_active(),
        )
    )


def _descendants() -> list[int]:
    """This process's live engine processes (titles ``VLLM::``; another node's on the
    same machine are not ours, nor is multiprocessing's resource tracker)."""
    import psutil

    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.status() != psutil.STATUS_ZOMBIE and c.name().startswith("VLLM::"):
                out.append(c.pid)
        except psutil.Error:
            pass
    return out


def cmd_multinode(args: argparse.Namespace) -> None:
    """Node 0 of a two-node engine (issue 43): TP=2 with one worker per node, vLLM's
    multi-node mp executor (``nnodes=2``); node 1 is ``vllm serve --headless`` started
    by the caller. Reports the greedy tokens, then, with ``--fault-window S``, prints
    ``GENERATING`` and keeps generating for ``S`` seconds while the caller injects a
    fault, and reports each batch's end (wall clock) and the error, if any."""
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        **ENGINE_ARGS,
        nnodes=2,
        node_rank=0,
        master_addr=os.environ.get("VLLM_HOST_IP", "127.0.0.1"),
        master_port=args.master_port,
    )
    started = time.perf_counter() - t0
    ps = prompts(args.prompts)
    outputs = llm.generate(ps, sampling(args.max_tokens), use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    texts = [o.outputs[0].text for o in outputs]
    tpot = time_per_output_token(llm, ps[0], args.reps)
    pids = {os.getpid(), *_descendants()}
    live = {"shm_while_running": shm_names(pids), "plugin": plugin_active()}
    outcome: dict = {"error": None, "error_at": None, "batches_at": [], "hung": False}
    if args.fault_window:
        done = threading.Event()

        def watchdog() -> None:
            # A generate that never returns is a hang: report it and leave.
            if not done.wait(args.fault_window + args.limit):
                hung = {"tokens": tokens, "texts": texts, "hung": True, "engine_processes_after": _descendants()}
                result({**live, **outcome, **hung})
                os._exit(3)

        threading.Thread(target=watchdog, daemon=True).start()
        print(f"GENERATING {time.time()}", flush=True)
        end = time.monotonic() + args.fault_window
        try:
            while time.monotonic() < end:
                llm.generate(prompts(16), sampling(32), use_tqdm=False)
                outcome["batches_at"].append(time.time())
        except Exception as e:  # vLLM's EngineDeadError (or what it raises instead)
            outcome["error_at"] = time.time()
            outcome["error"] = f"{type(e).__name__}: {e}"[:300]
            print(f"ERROR {outcome['error_at']}", flush=True)  # a timed fault may end now
        done.set()
    if args.end == "shutdown":
        llm.llm_engine.engine_core.shutdown()
    del llm, outputs
    gc.collect()
    ended_at = time.time()
    deadline = time.monotonic() + 20
    while _descendants() and time.monotonic() < deadline:
        time.sleep(0.05)
    engine_gone_at = time.time()  # node 0's end: its last engine process is gone
    while shm_names(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    result(
        dict(
            **live,
            **outcome,
            engine_gone_at=engine_gone_at,
            start_s=started,
            tokens=tokens,
            texts=texts,
            time_per_output_token_s=tpot,
            ended_at=ended_at,
            shm_after=shm_names(pids),
            engine_processes_after=_descendants(),
        )
    )


def cmd_serve(argv: list[str]) -> None:
    """``vllm serve`` as its CLI runs it. The CPU build's distribution is ``vllm-cpu``, and
    vLLM's CLI asks for the version of ``vllm``: answer as vLLM's own platform code does
    when that name is missing (the ``vllm-cpu`` version, marked ``+cpu``)."""
    import importlib.metadata as metadata

    original = metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return original(name)
            except metadata.PackageNotFoundError:
                return original("vllm-cpu") + "+cpu"
        return original(name)

    metadata.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *argv]
    main()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        cmd_serve(sys.argv[2:])
        return
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("offline")
    p.add_argument("model")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--end", choices=["scope", "shutdown"], default="scope")
    p.add_argument("--profile", action="store_true", help="time the engine processes' queue calls")
    p = sub.add_parser("mm")
    p.add_argument("model")
    p.add_argument("--cache", choices=["shm", "lru"], default="shm")
    p.add_argument("--cache-mib", type=float, default=256, help="mm_processor_cache_gb, in MiB")
    p.add_argument("--sequence", default="0,1,2,0,1,2,0,1,2", help="the image of each request")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--end", choices=["scope", "shutdown"], default="scope")
    p.add_argument("--ec-both", metavar="NAME", help="with shmq's encoder-cache connector as ec_both, cache NAME")
    p.add_argument("--max-model-len", type=int, default=256, help="2560 for the real-sized Llava's 4 images")
    p.add_argument("--then-kill-worker", choices=["idle", "generating"], help="then the worker-death run")
    p.add_argument("--concurrent", type=int, default=0, metavar="N",
                   help="then N one-image requests at once, new images, and the same N again")
    p = sub.add_parser("epd")
    p.add_argument("model")
    p.add_argument("--role", choices=["ec_producer", "ec_consumer", "ec_both", "none"], required=True)
    p.add_argument("--name", default="vllm")
    p.add_argument("--connector", choices=["shmq", "example"], default="shmq")
    p.add_argument("--storage", default="/tmp")
    p.add_argument("--max-model-len", type=int, default=256, help="1024 for the real-sized Llava")
    p.add_argument("--remote-handle-file", help="shmq's connector across nodes: the file naming the encoder's stream")
    p.add_argument("--remote-ip", help="the address the encoder's stream binds (with --remote-handle-file)")
    p = sub.add_parser("multinode")
    p.add_argument("model")
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--fault-window", type=float, default=0.0)
    p.add_argument("--limit", type=float, default=90.0, help="seconds past the window that count as a hang")
    p.add_argument("--end", choices=["scope", "shutdown"], default="scope")
    p = sub.add_parser("worker-death")
    p.add_argument("model")
    p.add_argument("--when", choices=["idle", "generating"], default="generating")
    p.add_argument("--images", action="store_true")
    p.add_argument("--limit", type=float, default=60.0)
    p = sub.add_parser("sparse")
    p.add_argument("model")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--every", type=float, default=0.5)
    p.add_argument("--idle", type=float, default=5.0)
    args = parser.parse_args()
    commands = {
        "offline": cmd_offline,
        "mm": cmd_mm,
        "epd": cmd_epd,
        "multinode": cmd_multinode,
        "worker-death": cmd_worker_death,
        "sparse": cmd_sparse,
    }
    commands[args.command](args)


if __name__ == "__main__":  # vLLM's workers are spawned: they re-import this file
    main()
