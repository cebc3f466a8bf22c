"""shmq as vLLM's encoder-cache connector: disaggregated encoding on one machine.

An *encoder* instance of vLLM (``"ec_role": "ec_producer"``) runs the vision encoder and
saves each item's embeddings into shmq's encoder cache (:mod:`shmq.encoder_cache`); a
*prefill/decode* instance (``"ec_consumer"``) finds them there by the item's hash and
every one of its workers loads them as zero-copy views, so it never runs the encoder for
them. Both instances name the same cache::

    vllm serve MODEL --ec-transfer-config '{"ec_connector": "ShmqECConnector",
        "ec_connector_module_path": "shmq.vllm_ec_connector", "ec_role": "ec_producer",
        "ec_connector_extra_config": {"name": "epd"}}'

and the same with ``"ec_role": "ec_consumer"`` for the prefill/decode instance. With the
plugin on (``SHMQ_VLLM=1``) the connector is registered by name and
``ec_connector_module_path`` may be left out. ``ec_both`` (an instance that saves what
it encodes and loads what another saved) works too. Clients send each image with a
``uuid`` (``multi_modal_uuids`` offline, ``"uuid"`` beside an image in a chat request)
so that both instances name the item alike, as for any vLLM EC connector.

``ec_connector_extra_config``:

- ``name``: the cache both instances open, one per deployment on a machine (its segment
  is ``/dev/shm/shmq_ec_<name>``). By default ``vllm-u<uid>-<digest of the model>``
  (:func:`default_cache_name`): the encoder and the prefill/decode instance of one user
  serving one model find each other without it, and deployments of other users or
  models never share a cache. Two deployments of the same model by the same user on one
  machine must each set their own (the second encoder refuses to start, naming the
  first's live producer). A segment under that name that is not this user's own is
  never opened (``PermissionError`` naming its owner);
- ``capacity_mb`` (default 1024), ``max_entries`` (default 4096): the producer's cache;
- ``save_timeout_s`` (default 1.0): how long a save waits for room when the cache is
  full, once unread items have been evicted; after it the item is not cached (a
  warning), the consumer encodes it itself;
- ``unread_ttl_s`` (default 30): an item no consumer worker has loaded after this long
  is evicted when room is needed.

Which rank saves and loads, and what a killed encoder instance leaves: docs/design.md
("The encoder cache from Python"). Only imported inside vLLM (it subclasses vLLM's
``ECConnectorBase``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from .encoder_cache import EncoderCacheConsumer, EncoderCacheIndex, EncoderCacheProducer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["ShmqECConnector", "ShmqECConnectorMetadata", "default_cache_name"]

log = logging.getLogger("vllm.shmq.ec_connector")

#: The name vLLM's ``ECConnectorFactory`` knows this connector by (with the plugin on).
NAME = "ShmqECConnector"


@dataclass
class ShmqECConnectorMetadata(ECConnectorMetadata):
    """One step's keys (``mm_hash``) for the consumer workers to load, with their number
    of encoder tokens."""

    mm_hashes: dict[str, int] = field(default_factory=dict)


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 outside a parallel group)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # the group is not set up (a single process)
        return 0


def default_cache_name(vllm_config: "VllmConfig") -> str:
    """The cache's name when ``ec_connector_extra_config`` names none: this user's and
    this model's (``vllm-u<uid>-<12 hex digits of the model's name or path>``), the same
    in the encoder and the prefill/decode instance that serve it."""
    model = str(getattr(vllm_config.model_config, "model", "") or "")
    digest = hashlib.sha256(model.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"vllm-u{os.geteuid()}-{digest}"


class ShmqECConnector(ECConnectorBase):
    """vLLM's ``ECConnectorBase`` over shmq's encoder cache (see the module docs)."""

    def __init__(self, vllm_config: "VllmConfig", role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        config = vllm_config.ec_transfer_config
        assert config is not None  # the base class refused it otherwise
        extra = config.ec_connector_extra_config or {}
        name = extra.get("name")
        self.cache_name = str(name) if name is not None else default_cache_name(vllm_config)
        self._save_timeout = float(extra.get("save_timeout_s", 1.0))
        self._unread_ttl = float(extra.get("unread_ttl_s", 30.0))
        self._to_load: dict[str, int] = {}
        self.index: Optional[EncoderCacheIndex] = None
        self.producer: Optional[EncoderCacheProducer] = None
        self.consumer: Optional[EncoderCacheConsumer] = None
        self._saved: OrderedDict[str, float] = OrderedDict()  # key -> when saved (producer)
        self._loaded = 0
        self._saves = 0
        self._metadata_resolver: Any = None
        if role == ECConnectorRole.SCHEDULER:
            if self.is_consumer:
                self.index = EncoderCacheIndex(self.cache_name)
            if self.is_producer:
                try:
                    from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver

                    self._metadata_resolver = PlaceholderMetadataResolver(vllm_config.model_config)
                except ImportError:  # a vLLM without it: no item metadata in ec_transfer_params
                    self._metadata_resolver = None
        else:
            if self.is_producer and _tp_rank() == 0:
                self.producer = EncoderCacheProducer(
                    self.cache_name,
                    capacity=int(float(extra.get("capacity_mb", 1024)) * (1 << 20)),
                    max_entries=int(extra.get("max_entries", 4096)),
                    timeout=self._save_timeout,
                )
            if self.is_consumer:
                self.consumer = EncoderCacheConsumer(self.cache_name)
        log.info(
            "shmq encoder-cache connector: %s side, %s, cache %r",
            "scheduler" if role == ECConnectorRole.SCHEDULER else f"worker (TP rank {_tp_rank()})",
            config.ec_role,
            self.cache_name,
        )

    # -- scheduler side --------------------------------------------------------------

    def has_cache_item(self, identifier: str) -> bool:
        """Whether the encoder output of ``identifier`` (an ``mm_hash``) is in the cache.
        An encode-only producer always encodes (it has no consumer side to load with)."""
        return self.index is not None and self.index.has(identifier)

    def update_state_after_alloc(self, request: "Request", index: int) -> None:
        if self.index is None:
            return
        mm_hash = request.mm_features[index].identifier
        if self.index.has(mm_hash):
            self._to_load[mm_hash] = request.get_num_encoder_embeds(index)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> ShmqECConnectorMetadata:
        meta = ShmqECConnectorMetadata(mm_hashes=self._to_load)
        self._to_load = {}
        return meta

    def request_finished(self, request: "Request") -> tuple[bool, Optional[dict[str, Any]]]:
        """Nothing is held for the request (the cache holds the items); a producer
        reports each item's placeholder metadata in ``ec_transfer_params``, as vLLM's
        own connectors do."""
        if not self.is_producer or self._metadata_resolver is None:
            return False, None
        from vllm.distributed.ec_transfer.ec_connector.utils import collect_ec_item_metadata

        items = collect_ec_item_metadata(request.mm_features, self._metadata_resolver)
        return False, (items or None)

    # -- worker side -----------------------------------------------------------------

    def start_load_caches(self, encoder_cache: dict[str, Any], **kwargs: Any) -> None:
        """Load this step's items into ``encoder_cache`` (zero-copy views of the cache);
        items this worker has already are only acknowledged."""
        if self.consumer is None:
            return
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ShmqECConnectorMetadata)
        keys = list(metadata.mm_hashes)
        if not keys:
            return
        self.consumer.load([k for k in keys if k in encoder_cache])
        missing = self.consumer.load([k for k in keys if k not in encoder_cache], encoder_cache)
        if not self._loaded and len(missing) < len(keys):
            rank = _tp_rank()
            log.info("shmq encoder-cache connector: first item loaded from %r (TP rank %d)", self.cache_name, rank)
        self._loaded += len(keys) - len(missing)
        if missing:
            # Evicted between the scheduler's lookup and this load (only an item left
            # unread past unread_ttl_s can be): vLLM fails the request when it looks.
            log.error(
                "shmq encoder-cache connector: items gone from cache %r before loading: %s", self.cache_name, missing
            )

    def save_caches(self, encoder_cache: dict[str, Any], mm_hash: str, **kwargs: Any) -> None:
        """Save ``encoder_cache[mm_hash]`` (TP rank 0 only). Returns once room is
        reserved (the copy runs in the background); a full cache evicts unread items
        older than ``unread_ttl_s`` and waits ``save_timeout_s`` at most, then leaves
        the item uncached."""
        if self.producer is None:
            return
        try:
            self._save_or_evict(mm_hash, encoder_cache[mm_hash])
        except Exception as e:  # the item is not cached (the consumer encodes it): never the engine's failure
            log.error("shmq encoder-cache connector: %s not cached in %r: %s", mm_hash, self.cache_name, e)

    def _save_or_evict(self, mm_hash: str, value: Any) -> None:
        try:
            saved = self._save(mm_hash, value)
        except MemoryError:
            if not self._evict_unread():
                log.warning("shmq encoder-cache connector: cache %r full, %s not cached", self.cache_name, mm_hash)
                return
            try:
                saved = self._save(mm_hash, value)
            except MemoryError as e:
                log.warning("shmq encoder-cache connector: %s not cached: %s", mm_hash, e)
                return
        if saved:
            if not self._saves:
                log.info("shmq encoder-cache connector: first item saved to cache %r", self.cache_name)
            self._saves += 1
            self._saved[mm_hash] = time.monotonic()

    def _save(self, key: str, value: Any) -> bool:
        assert self.producer is not None
        return self.producer.save(key, value)

    def _evict_unread(self) -> bool:
        """Evict the items saved more than ``unread_ttl_s`` ago (those that are still
        there: the cache has already let go of the items every consumer loaded, when it
        needed room); whether any went."""
        assert self.producer is not None
        now = time.monotonic()
        held = set(self.producer.keys())
        evicted = False
        for key, when in list(self._saved.items()):
            if key not in held:
                del self._saved[key]
            elif now - when > self._unread_ttl:
                evicted |= self.producer.evict(key)
                del self._saved[key]
        if evicted:
            log.warning("shmq encoder-cache connector: evicted items of cache %r no consumer loaded", self.cache_name)
        return evicted

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """At the end of each step: a producer waits until this step's saves are
        published (their copies run in the background meanwhile), so that an item is in
        the cache before the encoder instance answers its request. Nothing is held for a
        request: ``(None, None)``."""
        if self.producer is not None:
            try:
                self.producer.flush(timeout=30.0)
            except TimeoutError as e:
                log.warning("shmq encoder-cache connector: saves not published yet: %s", e)
            except Exception as e:  # a failed copy: that item is not cached, the engine goes on
                log.error("shmq encoder-cache connector: a save to cache %r failed: %s", self.cache_name, e)
        return None, None

    def wait_for_save(self) -> None:
        """Wait until every save so far is published."""
        if self.producer is not None:
            self.producer.flush()

    def shutdown(self) -> None:
        for side in (self.producer, self.consumer, self.index):
            if side is not None:
                side.close()
        self.producer = self.consumer = self.index = None

    def stats(self) -> dict[str, int]:
        """This side's counts: items saved (producer) and loaded (consumer)."""
        return {"saved": self._saves, "loaded": self._loaded}
