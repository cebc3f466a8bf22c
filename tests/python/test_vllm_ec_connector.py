"""shmq's encoder-cache connector (``shmq.vllm_ec_connector``) as vLLM 0.33 loads it:
vLLM's own ``ECConnectorBase`` and ``ECTransferConfig``, the scheduler side in this
process and the workers' sides in others, over one shared-memory cache. (vLLM's engine
runs it end to end in ``tests/engine``: an encoder-only and a prefill/decode instance.)

Needs vLLM 0.33 in the environment (``tests/python/vllm-requirements.txt``), as the
plugin's tests.
"""

from __future__ import annotations

import os
import uuid
from types import SimpleNamespace

import pytest

from _processes import STEP
from _processes.vllm_children import ec_config, ec_worker

try:
    import vllm  # noqa: F401
except ImportError:  # pragma: no cover - depends on the environment
    if os.environ.get("SHMQ_REQUIRE_VLLM") == "1":
        raise
    pytest.skip("vLLM is not installed (see tests/python/vllm-requirements.txt)", allow_module_level=True)

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(300)


def _request(*identifiers: str) -> SimpleNamespace:
    """What the connector reads of vLLM's ``Request``."""
    features = [SimpleNamespace(identifier=i) for i in identifiers]
    return SimpleNamespace(request_id="r1", mm_features=features, get_num_encoder_embeds=lambda index: 16 + index)


@pytest.fixture
def ec_name():
    name = f"ect{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    left = [n for n in os.listdir("/dev/shm") if name in n]
    assert not left, left


def test_the_scheduler_finds_what_the_producer_saved_and_every_consumer_rank_loads_it(children, ec_name):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    from shmq.vllm_ec_connector import ShmqECConnector, ShmqECConnectorMetadata

    # vLLM's factory finds it by module path (and by name once the plugin registered it).
    found = ECConnectorFactory.get_connector_class(ec_config("ec_consumer", ec_name).ec_transfer_config)
    assert found is ShmqECConnector
    out = children.queue()
    cmds = {role: children.queue() for role in ("producer", "c0", "c1")}
    children.start(ec_worker, out, cmds["producer"], "ec_producer", ec_name, {})
    for c in ("c0", "c1"):
        children.start(ec_worker, out, cmds[c], "ec_consumer", ec_name, {})
    for _ in cmds:
        children.expect(out, "ready", timeout=4 * STEP)
    scheduler = ShmqECConnector(ec_config("ec_consumer", ec_name), ECConnectorRole.SCHEDULER)
    try:
        embedding = torch.arange(16 * 64, dtype=torch.bfloat16).reshape(16, 64)
        assert not scheduler.has_cache_item("image-a")
        cmds["producer"].put(("save", "image-a", embedding))
        assert children.expect(out, "saved")[1:] == ("image-a", 1)
        # Saved once: a second save of the same item copies nothing.
        cmds["producer"].put(("save", "image-a", embedding))
        assert children.expect(out, "saved")[1:] == ("image-a", 1)
        assert scheduler.has_cache_item("image-a") and not scheduler.has_cache_item("image-b")
        # The scheduler's step: the items found are the workers' to load.
        scheduler.update_state_after_alloc(_request("image-a", "image-b"), 0)
        scheduler.update_state_after_alloc(_request("image-a", "image-b"), 1)  # not held: encoded locally
        meta = scheduler.build_connector_meta(None)
        assert isinstance(meta, ShmqECConnectorMetadata) and meta.mm_hashes == {"image-a": 16}
        assert scheduler.build_connector_meta(None).mm_hashes == {}, "a new step starts empty"
        for c in ("c0", "c1"):
            cmds[c].put(("load", meta))
            got = children.expect(out, "loaded")[1]
            assert got == {"image-a": (float(embedding.float().sum()), (16, 64), True)}, got
    finally:
        scheduler.shutdown()
        for q in cmds.values():
            q.put(("stop",))
    for _ in cmds:
        children.expect(out, "stopped")
    children.join()


def test_items_no_consumer_loads_never_hold_the_producer(children, ec_name):
    # A consumer joined and never loads (requests that went to the encoder only): once
    # the cache is full, items unread past unread_ttl_s are evicted for new ones instead
    # of every later save failing.
    out = children.queue()
    cmds = {role: children.queue() for role in ("producer", "c0")}
    extra = {"capacity_mb": 1, "save_timeout_s": 0.2, "unread_ttl_s": 0}
    children.start(ec_worker, out, cmds["producer"], "ec_producer", ec_name, extra)
    children.start(ec_worker, out, cmds["c0"], "ec_consumer", ec_name, {})
    for _ in cmds:
        children.expect(out, "ready", timeout=4 * STEP)
    try:
        for n in range(6):  # 6 x 384 KiB through 1 MiB
            cmds["producer"].put(("save", f"item-{n}", torch.full((96, 1024), float(n))))
            assert children.expect(out, "saved")[1:] == (f"item-{n}", n + 1)
    finally:
        for q in cmds.values():
            q.put(("stop",))
    for _ in cmds:
        children.expect(out, "stopped")
    children.join()


def test_the_default_cache_name_is_the_users_and_the_models_not_a_shared_vllm():
    """Issue 54: the default name was ``vllm`` for every deployment of every user, which a
    stranger could take first. Now it is this user's and this model's: the encoder and
    the prefill/decode instance of one deployment agree on it without configuration."""
    from types import SimpleNamespace

    from shmq.vllm_ec_connector import default_cache_name

    def config(model: str) -> SimpleNamespace:
        return SimpleNamespace(model_config=SimpleNamespace(model=model))

    name = default_cache_name(config("/models/llava-1.5-7b"))
    assert name == default_cache_name(config("/models/llava-1.5-7b"))
    assert name != default_cache_name(config("/models/qwen2.5-vl-7b"))
    assert name.startswith(f"vllm-u{os.geteuid()}-") and len(name.split("-")[-1]) == 12


def test_one_connector_the_deprecated_encoder_cache_connector_runs_the_same_code():
    """Issue 58: two connectors behaved differently. ``ShmqECConnector`` is the one; its
    vLLM-free half (``shmq._ec_connector._Connector``) is also the deprecated
    ``EncoderCacheConnector``, so every call vLLM makes runs the same code in both."""
    from shmq._ec_connector import _Connector
    from shmq.encoder_cache import EncoderCacheConnector
    from shmq.vllm_ec_connector import ShmqECConnector

    assert issubclass(ShmqECConnector, _Connector) and issubclass(EncoderCacheConnector, _Connector)
    for method in ("has_cache_item", "update_state_after_alloc", "build_connector_meta", "bind_connector_metadata",
                   "clear_connector_metadata", "start_load_caches", "save_caches", "get_finished", "wait_for_save",
                   "shutdown"):
        assert getattr(ShmqECConnector, method) is getattr(EncoderCacheConnector, method), method


def test_across_nodes_the_scheduler_fills_this_nodes_cache_from_the_encoders_stream(children, ec_name, tmp_path):
    # remote_handle_file: the encoder's TP rank 0 sends over shmq's remote stream, the
    # prefill/decode instance's scheduler (this process) joins it and writes into this
    # node's cache, from which a worker (another process) loads. (The encoder in a
    # /dev/shm of its own, and vLLM's engine on both sides: test_ec_remote.py and
    # tests/engine/test_multinode.py.)
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from shmq.vllm_ec_connector import ShmqECConnector

    handle = str(tmp_path / "epd.handle")
    scheduler = ShmqECConnector(ec_config("ec_consumer", ec_name, remote_handle_file=handle), ECConnectorRole.SCHEDULER)
    try:
        out = children.queue()
        cmds = {role: children.queue() for role in ("encoder", "c0")}
        children.start(ec_worker, out, cmds["encoder"], "ec_producer", ec_name,
                       {"remote_handle_file": handle, "remote_ip": "127.0.0.1"})
        children.start(ec_worker, out, cmds["c0"], "ec_consumer", ec_name, {})
        for _ in cmds:
            children.expect(out, "ready", timeout=4 * STEP)
        embedding = torch.arange(16 * 64, dtype=torch.bfloat16).reshape(16, 64)
        cmds["encoder"].put(("save", "image-a", embedding))
        assert children.expect(out, "saved")[1:] == ("image-a", 1)
        # The encoder's save returned (its wait_for_save): node 0's cache holds the item.
        assert scheduler.has_cache_item("image-a")
        scheduler.update_state_after_alloc(_request("image-a"), 0)
        cmds["c0"].put(("load", scheduler.build_connector_meta(None)))
        got = children.expect(out, "loaded")[1]
        assert got == {"image-a": (float(embedding.float().sum()), (16, 64), True)}
        for c in cmds.values():
            c.put(("stop",))
        for _ in cmds:
            children.expect(out, "stopped")
        assert not os.path.exists(handle)  # the encoder's normal end takes its file
    finally:
        scheduler.shutdown()


def test_an_ec_both_instance_with_a_remote_handle_file_is_refused(ec_name, tmp_path):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from shmq.vllm_ec_connector import ShmqECConnector

    config = ec_config("ec_both", ec_name, remote_handle_file=str(tmp_path / "epd.handle"))
    for role in (ECConnectorRole.SCHEDULER, ECConnectorRole.WORKER):
        with pytest.raises(ValueError, match="ec_both instance encodes and loads on one node"):
            ShmqECConnector(config, role)
