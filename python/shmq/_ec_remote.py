"""The encoder-cache connector across nodes: the encoder instance on one node, the
prefill/decode instance on another (:mod:`shmq.vllm_ec_connector`, ``remote_handle_file``).

The encoder's TP rank 0 (:class:`RemoteSender`) is the writer of a remote stream
(a :class:`~shmq.MessageQueue` with one remote reader and no local one: ZeroMQ over TCP,
authenticated by the handle's secret, with heartbeats) and writes the stream's handle
into ``remote_handle_file``, owner-only. The prefill/decode instance's scheduler process
(:class:`RemoteIntake`) reads that file, joins the stream as its reader, and writes each
item it receives, once, into its own node's encoder cache as that cache's producer;
every TP rank of the instance loads it from there, as on one machine.

Each item is two messages, its key (raw bytes) then its tensor (a typed array): nothing
from the other node is unpickled. The encoder's ``get_finished`` waits until the intake
acknowledged every item sent (it acknowledges when it asks for its next message, after
the item is published in its cache): an item is in node 0's cache before the encoder
instance answers its request. A file not owned by this user, or that others may write,
is refused: its secret would let its owner feed this process's cache.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from typing import Any, Optional

from ._ec_connector import _Connector

log = logging.getLogger("shmq.encoder_cache")

#: How long the encoder waits, at a save, for the prefill/decode instance to join its
#: stream (the first save after a (re)start; later saves never wait for it).
JOIN_TIMEOUT = 1.0
#: How often the intake looks at the handle file while it has no live stream.
POLL_S = 0.2
#: How long the intake waits for its connection to an encoder's port before it takes the
#: handle for a dead encoder's (and waits for a new file).
CONNECT_TIMEOUT = 10.0


def read_handle_file(path: str) -> Optional[str]:
    """The text of the handle file at ``path`` (``None`` while there is none). Refuses
    (``PermissionError``) a file that is not a regular file of this user's, or that its
    group or others may write or read: its secret would be another user's stream."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PermissionError(f"the encoder's handle file {path!r} is a symbolic link: refused") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PermissionError(f"the encoder's handle file {path!r} is not a regular file: refused")
        if st.st_uid != os.geteuid():
            raise PermissionError(
                f"the encoder's handle file {path!r} belongs to uid {st.st_uid}, not to this user "
                f"(uid {os.geteuid()}): refused (its stream is not ours)"
            )
        if st.st_mode & 0o077:
            raise PermissionError(
                f"the encoder's handle file {path!r} has mode {stat.S_IMODE(st.st_mode):o}: others may read or "
                "write it, refused (it must be 600: the encoder writes it so)"
            )
        with os.fdopen(fd, "r", encoding="ascii", closefd=False) as f:
            return f.read().strip() or None
    finally:
        os.close(fd)


def write_handle_file(path: str, text: str) -> None:
    """Write ``text`` into ``path`` at once (a new owner-only file renamed over it)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, text.encode("ascii") + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


class RemoteSender:
    """The encoder instance's side (its TP rank 0): the stream's writer, in the place of an
    ``EncoderCacheProducer`` (the calls the connector makes: ``save``, ``flush``,
    ``keys``, ``evict``, ``close``). ``ip``: the address its port binds (default this
    host's, as ``MessageQueue``'s ``connect_ip``)."""

    def __init__(
        self, handle_file: str, ip: Optional[str] = None, timeout: float = 1.0, logger: Optional[logging.Logger] = None
    ):
        self.handle_file = handle_file
        self.ip = ip
        self.timeout = timeout
        self._log = logger or log
        self._queue: Any = None
        self._handle = ""
        self._ready = False
        self._start()

    def _start(self) -> None:
        from .message_queue import MessageQueue

        queue = MessageQueue(1, 0, connect_ip=self.ip)
        self._handle = str(queue.export_handle())
        write_handle_file(self.handle_file, self._handle)
        self._queue, self._ready = queue, False
        self._log.info("shmq encoder-cache connector: stream for another node's cache in %r", self.handle_file)

    def _restart(self) -> None:
        """A new stream (and handle file) in place of this one."""
        self._queue.shutdown()
        self._start()

    def _joined(self) -> bool:
        """Whether the prefill/decode instance's intake is on the stream (waiting for it
        at most ``JOIN_TIMEOUT``); a stream whose intake went is made again (a new
        handle file, for the intake's next start)."""
        if self._ready and self._queue.lost_remote_readers():
            self._log.warning(
                "shmq encoder-cache connector: the other node's intake left the stream; a new one is in %r",
                self.handle_file,
            )
            self._restart()
        if not self._ready:
            try:
                self._queue.wait_until_ready(JOIN_TIMEOUT)
            except TimeoutError:
                return False
            self._ready = True
        return True

    def save(self, key: str, value: Any) -> bool:
        """Send ``key`` and its tensor to the other node's cache; ``False`` (nothing
        sent) while no intake is on the stream, or for a value that is no tensor."""
        import torch

        if not isinstance(value, torch.Tensor):
            raise TypeError(f"only a tensor goes to another node's cache, {key!r} is a {type(value).__name__}")
        if not self._joined():
            self._log.warning(
                "shmq encoder-cache connector: no prefill/decode instance on the stream of %r yet; %s not sent",
                self.handle_file,
                key,
            )
            return False
        self._queue.enqueue_bytes(key.encode("utf-8"), self.timeout)  # nothing sent if it fails
        try:
            self._queue.enqueue_array(value.detach().cpu().contiguous(), self.timeout)
        except BaseException:
            # A key without its tensor would leave the stream out of step: this stream
            # ends (the intake waits for the next), and a new one begins.
            self._restart()
            raise
        return True

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait until the other node's cache holds every item sent (its intake took them
        all: it takes the next only after publishing the last)."""
        if self._ready:
            self._queue.wait_remote_taken(timeout)

    def keys(self) -> list[str]:
        return []  # it holds nothing: the other node's cache does

    def evict(self, key: str) -> bool:
        return False

    def close(self) -> None:
        """End the stream (the intake sees it end after every item sent) and remove the
        handle file, if it is still this stream's (a newer encoder's stays)."""
        if self._queue is not None:
            self._queue.shutdown()
            self._queue = None
            try:
                if read_handle_file(self.handle_file) == self._handle:
                    os.unlink(self.handle_file)
            except (FileNotFoundError, PermissionError):
                pass


class _Saver(_Connector):
    """The connector's saving (room made by evicting unread items) for the intake."""

    def _metadata(self, to_load: Any) -> Any:
        return to_load


class RemoteIntake:
    """The prefill/decode instance's side (its scheduler process): a thread that reads the
    encoder's stream (its handle in ``handle_file``) and saves each item into this node's
    cache ``name`` as its producer (made here, at once: ``capacity``, ``max_entries``,
    ``timeout`` as for ``EncoderCacheProducer``; ``unread_ttl`` as the connector's). An
    encoder that dies or ends is waited for again: a new handle file is joined when it
    appears; the items already saved stay. :meth:`close` ends the thread."""

    _log = log

    def __init__(
        self,
        name: str,
        handle_file: str,
        *,
        capacity: int,
        max_entries: int,
        timeout: float,
        unread_ttl: float,
        logger: Optional[logging.Logger] = None,
    ):
        from .encoder_cache import EncoderCacheProducer

        read_handle_file(handle_file)  # refused at once if it is not ours
        self.name, self.handle_file = name, handle_file
        self._producer = EncoderCacheProducer(name, capacity=capacity, max_entries=max_entries, timeout=timeout)
        self._saver = _Saver(name, is_producer=True, is_consumer=False, producer=self._producer, unread_ttl=unread_ttl)
        self._saver._log = self._log = logger or log
        self._stop = threading.Event()
        self.received = 0
        self._thread = threading.Thread(target=self._run, name=f"shmq-ec-intake-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failed: Optional[str] = None  # the handle of a stream that ended or was never reached
        while not self._stop.is_set():
            try:
                text = read_handle_file(self.handle_file)
            except PermissionError as e:
                self._log.error("shmq encoder-cache connector: %s", e)
                text = None
            if text is None or text == failed:
                self._stop.wait(POLL_S)
                continue
            failed = text
            self._follow(text)

    def _follow(self, text: str) -> None:
        """Read the stream of ``text`` until it ends (or :meth:`close`)."""
        from .message_queue import Handle, MessageQueue

        try:
            queue = MessageQueue.create_from_handle(Handle.from_str(text), 0)
        except Exception as e:
            self._log.warning(
                "shmq encoder-cache connector: cannot join the encoder's stream (%s): %s", self.handle_file, e
            )
            return
        try:
            deadline = time.monotonic() + CONNECT_TIMEOUT
            while True:  # in slices, so that close() is not kept waiting
                try:
                    queue.wait_until_ready(0.2)
                    break
                except TimeoutError:
                    if self._stop.is_set() or self._replaced(text):
                        return  # closed, or a newer encoder wrote the file: join that one
                    if time.monotonic() > deadline:
                        raise
            self._log.info("shmq encoder-cache connector: joined the encoder's stream of %r", self.handle_file)
            while not self._stop.is_set():
                try:
                    key = queue.dequeue_bytes(cancel=self._stop).decode("utf-8")
                    value = queue.dequeue_array(cancel=self._stop, kind="torch")
                except RuntimeError:
                    if self._stop.is_set():
                        return
                    raise
                self._saver._save_or_evict(key, value)
                # Published before the next dequeue: that call acknowledges this item.
                self._producer.flush(timeout=30.0)
                self.received += 1
        except Exception as e:  # the encoder died, ended or went silent: wait for its next stream
            if not self._stop.is_set():
                self._log.warning(
                    "shmq encoder-cache connector: the encoder's stream (%s) ended: %s; the items received stay, "
                    "new ones are encoded here until an encoder writes a new handle",
                    self.handle_file,
                    e,
                )
        finally:
            queue.shutdown()

    def _replaced(self, text: str) -> bool:
        try:
            return read_handle_file(self.handle_file) not in (None, text)
        except PermissionError:
            return False

    def close(self, timeout: float = 5.0) -> None:
        """End the thread (its dequeue is cancelled at once) and close the cache."""
        self._stop.set()
        self._thread.join(timeout)
        self._producer.close()
