"""``StatelessProcessGroup``, and the collectives ``MessageQueue.create_from_process_group`` uses.

``StatelessProcessGroup`` is the engines' small process group on a key-value store:
processes exchange pickled Python objects through a ``torch.distributed.TCPStore``
(hosted by rank 0) without touching torch's global process group.

``MessageQueue.create_from_process_group`` (in ``message_queue``, which uses this
module's collectives) finds which ranks share the writer's machine, makes the writer
with those as local readers and the others as remote readers, sends the handle through
the group and opens the readers.

Same-machine detection (``in_the_same_node_as``) never compares host names: the
writer creates a tiny probe segment and every rank tries to open it by name, so ranks
that see a different ``/dev/shm`` (another machine, another container) count as
remote. Tests that need remote readers on one machine replace
``shmq.group.in_the_same_node_as`` (in every rank, since it is collective) with a
function that reports only the writer as local; ``create_from_process_group`` looks it
up in this module at call time for that reason.

torch is imported only when a group is created or a torch ``ProcessGroup`` is used, so
``import shmq`` does not import torch.
"""

from __future__ import annotations

import dataclasses
import pickle
import sys
import time
from collections import deque
from typing import Any, Callable, Optional

from . import _core
from ._cleanup import created_segments

__all__ = [
    "StatelessProcessGroup",
    "in_the_same_node_as",
]

_PROTOCOL = pickle.HIGHEST_PROTOCOL

#: A framework's own rule for which ranks share the reader's machine, where the framework
#: decides that itself: ``rule(pg, reader_rank)`` → one bool per rank of ``pg`` (a
#: ``torch.distributed`` group). ``shmq.vllm_plugin.activate()`` sets vLLM's (by device
#: count); ``MessageQueue.create_from_process_group_single_reader`` follows it where its
#: caller states nothing, and probes ``/dev/shm`` where it is unset.
locality_rule: Optional[Callable[[Any, int], list[bool]]] = None

# How often barrier() looks for the other ranks' arrival keys.
_BARRIER_POLL_S = 0.005


@dataclasses.dataclass
class StatelessProcessGroup:
    """A group of ``world_size`` processes exchanging Python objects through ``store``
    (a ``torch.distributed.TCPStore`` hosted by rank 0).

    Store keys:

    - ``send_to/{dst}/from/{src}/{n}``: the ``n``-th object ``src`` sent to ``dst``
      (``send_obj``/``recv_obj``; one counter per (src, dst) pair, so sends and
      receives pair up in order even when several ranks send to the same one);
    - ``broadcast_from/{src}/{n}``: the ``n``-th object ``src`` broadcast;
    - ``barrier/{n}/{rank}``: ``rank`` arrived at barrier round ``n``;
      ``barrier/{n}/left/{rank}``: it left (rank 0 waits for these, see ``barrier``).

    Every key this rank sets is remembered with the time it was set; ``expire_data()``
    (also called by every send and broadcast) deletes those older than
    ``data_expiration_seconds``. Readers must have read an entry by then.
    """

    rank: int
    world_size: int
    store: Any
    data_expiration_seconds: int = 3600

    send_dst_counter: dict[int, int] = dataclasses.field(default_factory=dict)
    recv_src_counter: dict[int, int] = dataclasses.field(default_factory=dict)
    broadcast_send_counter: int = 0
    broadcast_recv_src_counter: dict[int, int] = dataclasses.field(default_factory=dict)
    # (key, time set) of the keys this rank set, oldest first (vLLM's order).
    entries: deque = dataclasses.field(default_factory=deque)
    # After vLLM 0.33's fields, so that positional arguments land where vLLM puts them.
    barrier_counter: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in 0..{self.world_size - 1}")
        for r in range(self.world_size):
            self.send_dst_counter.setdefault(r, 0)
            self.recv_src_counter.setdefault(r, 0)
            self.broadcast_recv_src_counter.setdefault(r, 0)

    @staticmethod
    def create(
        host: str,
        port: int,
        rank: int,
        world_size: int,
        data_expiration_seconds: int = 3600,
        store_timeout: int = 300,
        listen_socket: Any = None,
    ) -> "StatelessProcessGroup":
        """Join the group: rank 0 hosts a ``TCPStore`` on ``host:port`` and waits for
        the others to connect; every blocking store call times out after
        ``store_timeout`` seconds. ``listen_socket`` (vLLM 0.33): rank 0 serves on this
        already-bound, listening socket instead of binding ``host:port`` itself (the
        store takes it over)."""
        import datetime

        from torch.distributed import TCPStore

        options: dict[str, Any] = dict(
            host_name=host,
            port=port,
            world_size=world_size,
            is_master=(rank == 0),
            timeout=datetime.timedelta(seconds=store_timeout),
        )
        if listen_socket is not None and rank == 0:
            fd = listen_socket.detach()
            try:
                store = TCPStore(**options, master_listen_fd=fd, use_libuv=False)
            except BaseException:
                import os

                os.close(fd)
                raise
        else:
            store = TCPStore(**options)
        return StatelessProcessGroup(
            rank=rank, world_size=world_size, store=store, data_expiration_seconds=data_expiration_seconds
        )

    # -- keys -----------------------------------------------------------------------

    def _send_key(self, src: int, dst: int, n: int) -> str:
        return f"send_to/{dst}/from/{src}/{n}"

    def _set(self, key: str, obj: Any) -> None:
        self.store.set(key, pickle.dumps(obj, protocol=_PROTOCOL))
        self.entries.append((key, time.time()))

    def _check_rank(self, r: int, what: str) -> None:
        if not 0 <= r < self.world_size:
            raise ValueError(f"{what} rank {r} is not in 0..{self.world_size - 1}")

    # -- point to point ------------------------------------------------------------

    def send_obj(self, obj: Any, dst: int) -> None:
        """Send ``obj`` to rank ``dst`` (does not wait for it to be received)."""
        self._check_rank(dst, "destination")
        self.expire_data()
        n = self.send_dst_counter[dst]
        self._set(self._send_key(self.rank, dst, n), obj)
        self.send_dst_counter[dst] = n + 1

    def recv_obj(self, src: int) -> Any:
        """The next object rank ``src`` sent to this rank (waits up to the store
        timeout)."""
        self._check_rank(src, "source")
        n = self.recv_src_counter[src]
        obj = pickle.loads(self.store.get(self._send_key(src, self.rank, n)))
        self.recv_src_counter[src] = n + 1
        return obj

    # -- collectives ----------------------------------------------------------------

    def broadcast_obj(self, obj: Optional[Any], src: int) -> Any:
        """Rank ``src`` sends ``obj``; every rank returns it."""
        self._check_rank(src, "source")
        if self.rank == src:
            self.expire_data()
            self._set(f"broadcast_from/{src}/{self.broadcast_send_counter}", obj)
            self.broadcast_send_counter += 1
            return obj
        n = self.broadcast_recv_src_counter[src]
        obj = pickle.loads(self.store.get(f"broadcast_from/{src}/{n}"))
        self.broadcast_recv_src_counter[src] = n + 1
        return obj

    def all_gather_obj(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, as a list indexed by rank."""
        gathered = []
        for r in range(self.world_size):
            if r == self.rank:
                gathered.append(obj)
                self.broadcast_obj(obj, src=self.rank)
            else:
                gathered.append(self.broadcast_obj(None, src=r))
        return gathered

    def barrier(self, timeout: float = 30.0) -> None:
        """Wait until every rank has reached this barrier. ``RuntimeError`` naming the
        ranks that did not arrive when ``timeout`` seconds pass (this rank's round
        still counts as done, so a late rank that arrives afterwards passes it).

        Rank 0 hosts the store, so it also waits until every other rank has *left* the
        barrier: a barrier before exiting lets every rank exit without cutting the
        others off the store."""
        n = self.barrier_counter
        self.barrier_counter += 1
        self.expire_data()
        self._set(f"barrier/{n}/{self.rank}", b"")
        deadline = time.monotonic() + timeout
        what = f"barrier {n} timed out after {timeout} s"
        self._wait_for_keys(f"barrier/{n}", deadline, what, "did not arrive")
        if self.rank == 0:
            self._wait_for_keys(f"barrier/{n}/left", deadline, what, "did not leave")
        else:
            self._set(f"barrier/{n}/left/{self.rank}", b"")

    def _wait_for_keys(self, prefix: str, deadline: float, what: str, missing: str) -> None:
        """Wait until every other rank has set ``{prefix}/{rank}``."""
        pending = [r for r in range(self.world_size) if r != self.rank]
        while True:
            pending = [r for r in pending if not self.store.check([f"{prefix}/{r}"])]
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{what} on rank {self.rank}: rank(s) {pending} {missing}")
            time.sleep(_BARRIER_POLL_S)

    # -- tensors (vLLM 0.33's helpers: pickled through the store, for small tensors) ---

    def broadcast(self, tensor: Any, src: int) -> Any:
        """Rank ``src`` sends ``tensor``; every rank returns it (a new tensor elsewhere)."""
        self._check_rank(src, "source")
        if self.rank == src:
            self.expire_data()
            self._set(f"broadcast_tensor/{src}/{self.broadcast_send_counter}", tensor)
            self.broadcast_send_counter += 1
            return tensor
        n = self.broadcast_recv_src_counter[src]
        tensor = pickle.loads(self.store.get(f"broadcast_tensor/{src}/{n}"))
        self.broadcast_recv_src_counter[src] = n + 1
        return tensor

    def send(self, tensor: Any, dst: int) -> None:
        """Send ``tensor`` to rank ``dst``."""
        self._check_rank(dst, "destination")
        self.expire_data()
        n = self.send_dst_counter[dst]
        self._set(f"send_tensor/{dst}/from/{self.rank}/{n}", tensor)
        self.send_dst_counter[dst] = n + 1

    def recv(self, tensor: Any, src: int) -> Any:
        """Receive the next tensor ``src`` sent to this rank into ``tensor`` (copied in
        place) and return it."""
        self._check_rank(src, "source")
        n = self.recv_src_counter[src]
        received = pickle.loads(self.store.get(f"send_tensor/{self.rank}/from/{src}/{n}"))
        self.recv_src_counter[src] = n + 1
        tensor.copy_(received)
        return tensor

    def all_reduce(self, tensor: Any, op: Any = None) -> Any:
        """Every rank's ``tensor`` reduced with ``op`` (a ``torch.distributed.ReduceOp``:
        SUM, the default, PRODUCT, MAX or MIN); a new tensor."""
        import torch

        ops = {
            torch.distributed.ReduceOp.SUM: torch.Tensor.add_,
            torch.distributed.ReduceOp.PRODUCT: torch.Tensor.mul_,
            torch.distributed.ReduceOp.MAX: lambda a, b: torch.maximum(a, b, out=a),
            torch.distributed.ReduceOp.MIN: lambda a, b: torch.minimum(a, b, out=a),
        }
        combine = ops.get(torch.distributed.ReduceOp.SUM if op is None else op)
        if combine is None:
            raise ValueError(f"all_reduce supports SUM, PRODUCT, MAX and MIN, not {op}")
        tensors = self.all_gather_obj(tensor)
        result = tensors[0].clone()
        for t in tensors[1:]:
            combine(result, t)
        return result

    # -- housekeeping ----------------------------------------------------------------

    def expire_data(self) -> None:
        """Delete the keys this rank set more than ``data_expiration_seconds`` ago."""
        now = time.time()
        while self.entries:
            key, set_at = self.entries[0]
            if now - set_at <= self.data_expiration_seconds:
                break
            self.store.delete_key(key)
            self.entries.popleft()


# ---------------------------------------------------------------------------------
# The same collectives on either kind of group


def _is_torch_group(pg: Any) -> bool:
    torch_distributed = sys.modules.get("torch.distributed")
    group_type = getattr(torch_distributed, "ProcessGroup", None)
    return group_type is not None and isinstance(pg, group_type)


class _Ops:
    """rank / world_size / broadcast / all_gather over a StatelessProcessGroup or a
    ``torch.distributed.ProcessGroup`` (ranks are group ranks)."""

    def __init__(self, pg: Any):
        self.pg = pg
        # Any stateless group will do (shmq's, or vLLM's own StatelessProcessGroup when
        # vLLM's code hands it to shmq's MessageQueue): what is not a torch group.
        self.stateless = isinstance(pg, StatelessProcessGroup) or (
            hasattr(pg, "broadcast_obj") and hasattr(pg, "all_gather_obj") and not _is_torch_group(pg)
        )
        if self.stateless:
            self.rank, self.world_size = pg.rank, pg.world_size
        else:
            import torch.distributed as dist

            self.dist = dist
            self.rank, self.world_size = dist.get_rank(pg), dist.get_world_size(pg)
            if self.rank < 0:
                raise ValueError("this process is not a member of the given process group")

    def broadcast(self, obj: Any, src: int) -> Any:
        if self.stateless:
            return self.pg.broadcast_obj(obj, src=src)
        holder = [obj if self.rank == src else None]
        self.dist.broadcast_object_list(holder, src=self.dist.get_global_rank(self.pg, src), group=self.pg)
        return holder[0]

    def all_gather(self, obj: Any) -> list[Any]:
        if self.stateless:
            return self.pg.all_gather_obj(obj)
        gathered: list[Any] = [None] * self.world_size
        self.dist.all_gather_object(gathered, obj, group=self.pg)
        return gathered


def in_the_same_node_as(pg: Any, source_rank: int = 0) -> list[bool]:
    """Collective: for each group rank, whether it shares ``source_rank``'s machine
    (sees its shared memory). ``source_rank`` creates a probe segment and broadcasts
    its name; every rank tries to open it; the answers are all-gathered."""
    ops = _Ops(pg)
    if not 0 <= source_rank < ops.world_size:
        raise ValueError(f"source rank {source_rank} is not in 0..{ops.world_size - 1}")
    probe = None
    try:
        if ops.rank == source_rank:
            probe = _core.Ring.create(1, 64, 1)
            created_segments()
            ops.broadcast(probe.name, src=source_rank)
            here = True
        else:
            name = ops.broadcast(None, src=source_rank)
            try:
                opened = _core.Ring.open(name)
            except FileNotFoundError:
                here = False
            else:
                here = True
                del opened
        # The probe stays alive until every rank has tried it: all_gather is collective.
        return [bool(x) for x in ops.all_gather(here)]
    finally:
        del probe
