"""shmq's encoder-cache connector without vLLM: each call of
:class:`shmq.vllm_ec_connector.ShmqECConnector` (which adds vLLM's base class and
config), written once; the deprecated :class:`shmq.encoder_cache.EncoderCacheConnector`
is the same with a role string, so the two cannot differ. It imports no vLLM (``import
shmq`` must not) and nothing of the package: its callers hand it the cache's sides."""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, Iterable, Optional

log = logging.getLogger("shmq.encoder_cache")


class _Connector(ABC):
    """The connector's calls, as :class:`shmq.vllm_ec_connector.ShmqECConnector`
    documents them, over the sides its caller made for this side of the connector (the
    scheduler's: an ``index``, an ``EncoderCacheIndex``; a producer's TP rank 0: a
    ``producer``, an ``EncoderCacheProducer``; a consumer's worker: a ``consumer``, an
    ``EncoderCacheConsumer``; across nodes, a consumer's scheduler: an ``intake``, a
    ``shmq._ec_remote.RemoteIntake``; ``None`` for those it has not). Subclasses give the step's
    metadata its shape (:meth:`_metadata`)."""

    #: Where its lines go (``ShmqECConnector``'s: under vLLM's logger, into vLLM's log).
    _log = log

    def __init__(
        self,
        cache_name: str,
        *,
        is_producer: bool,
        is_consumer: bool,
        index: Any = None,
        producer: Any = None,
        consumer: Any = None,
        rank: int = 0,
        unread_ttl: float = 30.0,
        intake: Any = None,
    ):
        self._is_producer, self._is_consumer = is_producer, is_consumer
        self.index, self.producer, self.consumer = index, producer, consumer
        #: Across nodes, the scheduler's ``RemoteIntake`` (it fills this node's cache).
        self.intake = intake
        self.cache_name = cache_name
        self._rank = rank
        self._unread_ttl = unread_ttl
        self._connector_metadata: Any = None
        self._to_load: dict[str, Optional[int]] = {}
        self._saved: OrderedDict[str, float] = OrderedDict()  # key -> when saved (producer)
        self._unavailable: set[str] = set()
        self._loaded = 0
        self._saves = 0

    @property
    def is_producer(self) -> bool:
        return self._is_producer

    @property
    def is_consumer(self) -> bool:
        return self._is_consumer

    @abstractmethod
    def _metadata(self, to_load: dict[str, Optional[int]]) -> Any:
        """The step's keys to load (with their number of encoder tokens) as the workers
        get them: each connector's own metadata class (``ShmqECConnectorMetadata``,
        ``EncoderCacheMetadata``)."""

    # -- scheduler side --------------------------------------------------------------

    def has_cache_item(self, identifier: str) -> bool:
        """Whether the encoder output of ``identifier`` (an ``mm_hash``) is in the cache.
        An encode-only producer always encodes (it has no consumer side to load with)."""
        return self.index is not None and self.index.has(identifier)

    def update_state_after_alloc(self, request: Any, index: Optional[int] = None) -> None:
        """Note that this step needs the encoder output of ``request``'s ``index``-th
        multimodal item (or of the key ``request`` itself when it is a string): the
        workers load it if the cache holds it."""
        if self.index is None:
            return
        if isinstance(request, str):
            mm_hash, num_tokens = request, None
        else:
            assert index is not None, "index is needed with a request"
            mm_hash, num_tokens = request.mm_features[index].identifier, request.get_num_encoder_embeds(index)
        if self.index.has(mm_hash):
            self._to_load[mm_hash] = num_tokens

    def build_connector_meta(self, scheduler_output: Any = None) -> Any:
        """The keys to load this step (what ``update_state_after_alloc`` found); starts
        a new step."""
        meta = self._metadata(self._to_load)
        self._to_load = {}
        return meta

    # -- worker side -----------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> Any:
        assert self._connector_metadata is not None, "no connector metadata bound"
        return self._connector_metadata

    def start_load_caches(self, encoder_cache: dict[str, Any], **kwargs: Any) -> None:
        """Load this step's items into ``encoder_cache`` (zero-copy views of the cache,
        or on the consumer's device); items this worker has already are only
        acknowledged, items the cache no longer holds are logged
        (:meth:`take_unavailable`)."""
        if self.consumer is None:
            return
        keys = list(self._get_connector_metadata().mm_hashes)
        self._unavailable = set()
        if not keys:
            return
        self.consumer.load([k for k in keys if k in encoder_cache])
        missing = self.consumer.load([k for k in keys if k not in encoder_cache], encoder_cache)
        if not self._loaded and len(missing) < len(keys):
            self._log.info(
                "shmq encoder-cache connector: first item loaded from %r (TP rank %d)", self.cache_name, self._rank
            )
        self._loaded += len(keys) - len(missing)
        if missing:
            # Evicted between the scheduler's lookup and this load (only an item left
            # unread past unread_ttl_s can be): vLLM fails the request when it looks.
            self._log.error(
                "shmq encoder-cache connector: items gone from cache %r before loading: %s", self.cache_name, missing
            )
            self._unavailable = set(missing)

    def take_unavailable(self) -> set[str]:
        """The keys the last :meth:`start_load_caches` found gone (once)."""
        out, self._unavailable = self._unavailable, set()
        return out

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
            self._log.error("shmq encoder-cache connector: %s not cached in %r: %s", mm_hash, self.cache_name, e)

    def _save_or_evict(self, mm_hash: str, value: Any) -> None:
        assert self.producer is not None
        try:
            saved = self.producer.save(mm_hash, value)
        except MemoryError:
            if not self._evict_unread():
                self._log.warning(
                    "shmq encoder-cache connector: cache %r full, %s not cached", self.cache_name, mm_hash
                )
                return
            try:
                saved = self.producer.save(mm_hash, value)
            except MemoryError as e:
                self._log.warning("shmq encoder-cache connector: %s not cached: %s", mm_hash, e)
                return
        if saved:
            if not self._saves:
                self._log.info("shmq encoder-cache connector: first item saved to cache %r", self.cache_name)
            self._saves += 1
            self._saved[mm_hash] = time.monotonic()

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
            self._log.warning(
                "shmq encoder-cache connector: evicted items of cache %r no consumer loaded", self.cache_name
            )
        return evicted

    def get_finished(self, finished_req_ids: Iterable[str] = ()) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """At the end of each step: a producer waits until this step's saves are
        published (their copies run in the background meanwhile), so that an item is in
        the cache before the encoder instance answers its request. Nothing is held for a
        request (the cache holds the items): ``(None, None)``."""
        if self.producer is not None:
            try:
                self.producer.flush(timeout=30.0)
            except TimeoutError as e:
                self._log.warning("shmq encoder-cache connector: saves not published yet: %s", e)
            except Exception as e:  # a failed copy: that item is not cached, the engine goes on
                self._log.error("shmq encoder-cache connector: a save to cache %r failed: %s", self.cache_name, e)
        return None, None

    def wait_for_save(self, timeout: Optional[float] = None) -> None:
        """Wait until every save so far is published (``TimeoutError`` after ``timeout``)."""
        if self.producer is not None:
            self.producer.flush(timeout)

    def shutdown(self) -> None:
        for side in (self.producer, self.consumer, self.index, self.intake):
            if side is not None:
                side.close()
        self.producer = self.consumer = self.index = self.intake = None

    def stats(self) -> dict[str, int]:
        """This side's counts: items saved (producer) and loaded (consumer)."""
        return {"saved": self._saves, "loaded": self._loaded}
