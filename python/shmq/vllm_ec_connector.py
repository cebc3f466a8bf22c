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
  is evicted when room is needed;
- ``remote_handle_file``: the encoder instance on *another node* (its own ``/dev/shm``).
  Both instances name the same file, on a directory both nodes see (as
  ``ECExampleConnector``'s ``shared_storage_path``, but only this small file goes
  there): the encoder's TP rank 0 writes into it (owner-only) the handle of a remote
  stream it sends every item over (ZeroMQ over TCP, authenticated by the handle's
  secret, with heartbeats), and the prefill/decode instance's scheduler process reads
  it, joins the stream and writes each item, once, into its own node's cache ``name``,
  from which every TP rank loads it. The encoder answers a request only once the other
  node's cache holds its items. A file of another user's, or one others may read or
  write, is refused. An encoder that dies leaves what it sent loadable; the
  prefill/decode instance encodes new items itself, and joins the stream of the next
  encoder that writes the file;
- ``remote_ip`` (encoder, with ``remote_handle_file``): the address its stream's port
  binds (default this host's, as ``MessageQueue``'s ``connect_ip``).

Which rank saves and loads, and what a killed encoder instance leaves: docs/design.md
("The encoder cache from Python"). Only imported inside vLLM (it subclasses vLLM's
``ECConnectorBase``).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from ._ec_connector import _Connector
from .encoder_cache import EncoderCacheConsumer, EncoderCacheIndex, EncoderCacheProducer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

__all__ = ["ShmqECConnector", "ShmqECConnectorMetadata", "default_cache_name"]

log = logging.getLogger("vllm.shmq.ec_connector")

#: The name vLLM's ``ECConnectorFactory`` knows this connector by (with the plugin on).
NAME = "ShmqECConnector"


@dataclass
class ShmqECConnectorMetadata(ECConnectorMetadata):
    """One step's keys (``mm_hash``) for the consumer workers to load, with their number
    of encoder tokens (``None`` for a key given without its request)."""

    mm_hashes: dict[str, Optional[int]] = field(default_factory=dict)


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


class ShmqECConnector(_Connector, ECConnectorBase):
    """vLLM's ``ECConnectorBase`` over shmq's encoder cache, configured as the module
    docs say. The scheduler side of a consumer (``ec_consumer``, ``ec_both``) finds items
    in the cache's key index (that of an ``ec_producer`` finds nothing: an encode-only
    instance always encodes); a producer's TP rank 0 saves (every rank computes the same
    embeddings); every rank of a consumer loads. A call for a side this connector is not
    does nothing; nothing is held for a request (:meth:`get_finished` reports none); a
    failed save is logged, never the engine's failure (the consumer encodes the item).
    """

    # The calls vLLM makes, written once without vLLM (shmq._ec_connector, also the
    # deprecated EncoderCacheConnector's): named here so that the API reference documents
    # them on this class.
    has_cache_item = _Connector.has_cache_item
    update_state_after_alloc = _Connector.update_state_after_alloc
    build_connector_meta = _Connector.build_connector_meta
    start_load_caches = _Connector.start_load_caches
    take_unavailable = _Connector.take_unavailable
    save_caches = _Connector.save_caches
    get_finished = _Connector.get_finished
    wait_for_save = _Connector.wait_for_save
    shutdown = _Connector.shutdown
    stats = _Connector.stats

    _log = log  # the calls' lines under a "vllm." logger: into vLLM's own log

    def __init__(self, vllm_config: "VllmConfig", role: ECConnectorRole):
        ECConnectorBase.__init__(self, vllm_config=vllm_config, role=role)
        config = vllm_config.ec_transfer_config
        assert config is not None  # the base class refused it otherwise
        extra = config.ec_connector_extra_config or {}
        name = str(extra["name"]) if extra.get("name") is not None else default_cache_name(vllm_config)
        scheduler = role == ECConnectorRole.SCHEDULER
        rank = 0 if scheduler else _tp_rank()
        remote = extra.get("remote_handle_file")
        if remote and self.is_producer and self.is_consumer:
            raise ValueError(
                "ec_connector_extra_config's remote_handle_file joins an encoder instance (ec_producer) on one "
                "node to a prefill/decode instance (ec_consumer) on another; an ec_both instance encodes and loads "
                "on one node: leave remote_handle_file out"
            )
        producer: Any = None
        intake: Any = None
        if not scheduler and self.is_producer and rank == 0 and remote:
            from ._ec_remote import RemoteSender

            ip = extra.get("remote_ip")
            producer = RemoteSender(
                str(remote), str(ip) if ip else None, float(extra.get("save_timeout_s", 1.0)), logger=log
            )
        elif not scheduler and self.is_producer and rank == 0:
            producer = EncoderCacheProducer(
                name,
                capacity=int(float(extra.get("capacity_mb", 1024)) * (1 << 20)),
                max_entries=int(extra.get("max_entries", 4096)),
                timeout=float(extra.get("save_timeout_s", 1.0)),
            )
        if scheduler and self.is_consumer and remote:
            from ._ec_remote import RemoteIntake

            # This node's cache, filled from the encoder's stream: made before the index.
            intake = RemoteIntake(
                name,
                str(remote),
                capacity=int(float(extra.get("capacity_mb", 1024)) * (1 << 20)),
                max_entries=int(extra.get("max_entries", 4096)),
                timeout=float(extra.get("save_timeout_s", 1.0)),
                unread_ttl=float(extra.get("unread_ttl_s", 30.0)),
                logger=log,
            )
        _Connector.__init__(
            self,
            name,
            is_producer=self.is_producer,
            is_consumer=self.is_consumer,
            index=EncoderCacheIndex(name) if scheduler and self.is_consumer else None,
            producer=producer,
            consumer=EncoderCacheConsumer(name) if not scheduler and self.is_consumer else None,
            rank=rank,
            unread_ttl=float(extra.get("unread_ttl_s", 30.0)),
            intake=intake,
        )
        self._metadata_resolver: Any = None
        if scheduler and self.is_producer:
            try:
                from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver

                self._metadata_resolver = PlaceholderMetadataResolver(vllm_config.model_config)
            except ImportError:  # a vLLM without it: no item metadata in ec_transfer_params
                self._metadata_resolver = None
        log.info(
            "shmq encoder-cache connector: %s side, %s, cache %r",
            "scheduler" if scheduler else f"worker (TP rank {rank})",
            config.ec_role,
            self.cache_name,
        )

    def _metadata(self, to_load: dict[str, Optional[int]]) -> ShmqECConnectorMetadata:
        return ShmqECConnectorMetadata(mm_hashes=to_load)

    def request_finished(self, request: "Request") -> tuple[bool, Optional[dict[str, Any]]]:
        """Nothing is held for the request (the cache holds the items); a producer
        reports each item's placeholder metadata in ``ec_transfer_params``, as vLLM's
        own connectors do."""
        if not self.is_producer or self._metadata_resolver is None:
            return False, None
        from vllm.distributed.ec_transfer.ec_connector.utils import collect_ec_item_metadata

        items = collect_ec_item_metadata(request.mm_features, self._metadata_resolver)
        return False, (items or None)
