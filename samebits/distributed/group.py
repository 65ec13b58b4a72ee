"""The tensor-parallel process group and its collectives (gloo on CPU, NCCL on CUDA).

A ``TPGroup`` names this process's rank and the world size from construction (a model's layers
are sized from them before any process group exists); ``connect`` joins the process group.
With one rank there is no process group and every collective is the identity.

The invariant arithmetic uses only gathers: ``all_gather`` of fp32 row-parallel sums or
partials (tree-summed by the caller, the same fp32 additions as on one device) and of a mixture's
expert outputs (each slot then taken from the rank holding its expert), and ``gather_cat`` of row
blocks in rank order; no reduction order depends on N. ``all_reduce_sum`` (an all-reduce, whose
order is the library's) serves only the standard mode. Control messages (``broadcast_object``,
``min_int``) run over a gloo group on every device, so they never wait behind device work; with a
``queue`` attached (the engine's ranks), ``broadcast_object`` goes through that shared-memory
``MessageQueue`` instead -- a write and a poll, no round trip --, and only a message too large for
one of its slots through gloo.

``push_slot`` / ``push``: on CUDA (``SAMEBITS_TP_PUSH`` 1 or 2; 2 by default at two ranks), a
row-parallel layer's fp32 sums reach every rank through symmetric memory -- written into each
peer's buffer (copied, or at 2 with two ranks stored there by the GEMM itself:
``push_peer_slot``), then a device-side barrier that ``abort`` ends too -- instead of
``all_gather``, the same values in the same [N, T, H] slots
(``samebits.distributed.symmetric``: the buffers, their ring of two and why every rank takes the
same path). ``connect`` opens that exchange after its check, for the widest row a layer
``reserve_push``'d; rows above its capacity, and every group where it is off or failed to open,
take the gather.

Leaving the group is never collective, and comes after the CUDA graphs are gone: NCCL's abort,
finalize and destroy of a communicator all wait until every graph that captured one of its
collectives is destroyed. Ranks 1..N-1 drop their graphs, wait for their device and exit without
any teardown (``samebits.engine.worker``); rank 0 then ``leave``s alone -- NCCL's communicators
aborted, gloo's group destroyed, locally -- in a thread it waits for a bounded time. A release
that does not return is reported and left behind: this process then refuses to form another
group (``connect`` raises) instead of waiting on it.

With ``SAMEBITS_TP_TRACE`` set, each rank writes the collectives it issues, in order
(``_record``): ranks that would wait for each other show where their sequences part.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import urllib.parse
from collections.abc import Callable
from typing import TextIO

import torch
import torch.distributed as dist

from samebits import env
from samebits.distributed.message_queue import MessageQueue
from samebits.distributed.symmetric import RINGS, PushExchange, open_exchange, push_rows, takes_push

log = logging.getLogger("samebits.engine")

# a collective waits this long for its peers: long enough for a rank that loads or compiles
# slower than the others; a dead peer is noticed by the driver's watcher, not by this timeout
TIMEOUT = datetime.timedelta(minutes=30)
# how long rank 0, which connects only once every rank has loaded (each then connects at once),
# waits in the rendezvous for the others: a rank that died there is named, not waited for
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=20)
RELEASE_TIMEOUT_S = 10.0  # how long ``leave`` waits for this process's group to be released


# torch 2.13 names it all_gather_single (the old name warns); torch 2.11 has only the old one
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TPGroup:
    def __init__(self, rank: int = 0, world_size: int = 1,
                 device: torch.device | str = "cpu") -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.cpu_group = None  # gloo group for control messages (the default group on CPU)
        self.connected = False
        self.lock = threading.Lock()  # held by whatever aborts or releases the group: one at a time
        self.trace: TextIO | None = None  # SAMEBITS_TP_TRACE: this rank's collectives, in order
        self.queue: MessageQueue | None = None  # carries ``broadcast_object`` when attached
        self.push_width = 0  # the widest fp32 row a layer pushes (``reserve_push``)
        self.push_layers = 0  # layers that reserved one: the next one's ring is this mod RINGS
        self.exchange: PushExchange | None = None  # opened by ``connect`` where push is on
        # the ring of the last push since the last NCCL gather or all-reduce (None: none since)
        self.last_ring: int | None = None

    def connect(self, init_method: str, max_batched_tokens: int | None = None,
                push: bool = True, listener: int | None = None) -> None:
        """Join the process group (every rank calls this with the same ``init_method``), then
        check it: a gather on the device and a reduction over the control group, so both
        backends have connected here (NCCL's communicator too, before any forward or graph
        capture) and a wrong device or a broken transport fails now, not in a step. The push
        exchange, where opened, holds the rows of ``max_batched_tokens`` (the engine's
        ``max_num_batched_tokens``) up to ``PUSH_MAX_ROWS``; ``push`` False (the standard mode,
        whose layers all-reduce): none is opened (every rank is given the same value).
        ``listener``: rank 0's socket listening at ``init_method`` since before the other ranks
        started (``_store``)."""
        if self.world_size == 1 or self.connected:
            return
        check_free()
        cuda = self.device.type == "cuda"
        if cuda:  # NCCL's objects and buffers live on the current device
            torch.cuda.set_device(self.device)
        store = self._store(init_method, listener)
        dist.init_process_group("nccl" if cuda else "gloo", store=store,
                                rank=self.rank, world_size=self.world_size, timeout=TIMEOUT)
        self.connected = True  # from here on, rank 0 leaves with ``leave``
        self.trace = _open_trace(self.rank)
        self.cpu_group = dist.new_group(backend="gloo", timeout=TIMEOUT) if cuda else None
        ranks = self.all_gather(torch.tensor([self.rank], device=self.device)).tolist()
        if ranks != list(range(self.world_size)) or self.min_int(self.rank) != 0:
            raise RuntimeError(f"tensor-parallel group check failed on rank {self.rank}: the "
                               f"ranks gathered {ranks}")
        if push:
            self.exchange = open_exchange(self, self.push_width, push_rows(max_batched_tokens))
        store.set_timeout(TIMEOUT)  # formed: later store waits are the collectives' own

    def _store(self, init_method: str, listener: int | None) -> dist.TCPStore:
        """The rendezvous store at ``init_method`` (``tcp://host:port``), hosted by rank 0 on
        ``listener`` where given: the others connect as soon as they loaded, into that socket's
        backlog, so none is asleep in a connect back-off when rank 0 (which connects last, once
        every rank loaded) opens the store. Until the group is formed its waits time out after
        ``RENDEZVOUS_TIMEOUT`` on rank 0 and ``TIMEOUT`` on the others (which may wait for rank 0
        to load)."""
        url = urllib.parse.urlparse(init_method)
        driver = self.rank == 0
        return dist.TCPStore(url.hostname, url.port, self.world_size, is_master=driver,
                             timeout=RENDEZVOUS_TIMEOUT if driver else TIMEOUT,
                             master_listen_fd=listener if driver else None)

    def reserve_push(self, width: int) -> int:
        """A row-parallel layer's ring for its pushes, rings alternating in the order layers are
        built (a forward's order), and room for its rows of ``width`` fp32 values (layers ask
        when built, before ``connect`` allocates the buffers)."""
        self.push_width = max(self.push_width, width)
        self.push_layers += 1
        return (self.push_layers - 1) % RINGS

    def push_slot(self, ring: int, rows: int, width: int) -> torch.Tensor | None:
        """This rank's flat [rows * width] fp32 slot in ring ``ring``, for the layer to write its
        sum into before ``push``; None where the layer gathers instead (``takes_push``: the same
        answer on every rank for the same layer and step)."""
        if not takes_push(self.exchange, ring, self.last_ring, rows, width):
            return None
        return self.exchange.slot(ring, rows, width)

    def push_peer_slot(self, ring: int, rows: int, width: int) -> torch.Tensor | None:
        """After ``push_slot`` gave a slot: the peer's flat slot for the same sum (mapped here)
        where the exchange is fused (``SAMEBITS_TP_PUSH=2``, two ranks): the kernel that writes
        the slot writes it too (``linear_sum``'s ``peer_out``) and ``push`` copies nothing; None
        where ``push`` copies."""
        return self.exchange.peer_slot(ring, rows, width)

    def push(self, ring: int, rows: int, width: int) -> torch.Tensor:
        """[N, rows, width] fp32: every rank's slot of ring ``ring`` (written since
        ``push_slot``) in rank order -- ``all_gather``'s values, through symmetric memory."""
        if self.trace is not None:  # the slot only names the shape and dtype
            self._record("push", self.exchange.slot(ring, rows, width).view(rows, width))
        self.last_ring = ring
        return self.exchange.exchange(ring, rows, width)

    @property
    def backend(self) -> str:
        """The backends in use: the device's, and gloo's for control messages."""
        return "nccl + gloo" if self.device.type == "cuda" else "gloo"

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[k, ...] per rank -> [N k, ...] in rank order."""
        if self.world_size == 1:
            return x
        self._record("all_gather", x)
        self.last_ring = None  # every rank reaches it after its earlier reads: a barrier
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype,
                          device=x.device)
        _ALL_GATHER(out, x.contiguous())
        return out

    def gather_cat(self, local: torch.Tensor, sizes: list[int], dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``local`` along ``dim`` in rank order; rank r's block has
        ``sizes[r]`` entries along ``dim`` (blocks are padded to the largest for the gather)."""
        if self.world_size == 1:
            return local
        dim = dim % local.dim()
        pad = list(local.shape)
        pad[dim] = max(sizes) - local.shape[dim]
        padded = torch.cat([local, local.new_zeros(pad)], dim=dim) if pad[dim] else local
        blocks = self.all_gather(padded.unsqueeze(0))
        return torch.cat([blocks[r].narrow(dim, 0, sizes[r]) for r in range(self.world_size)],
                         dim=dim)

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The library's all-reduce (its own order): the standard mode's row-parallel sum."""
        if self.world_size > 1:
            self._record("all_reduce_sum", x)
            self.last_ring = None  # as ``all_gather``: a barrier
            dist.all_reduce(x)
        return x

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (the KV blocks every rank can hold)."""
        if self.world_size == 1:
            return value
        self._record("min_int")
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's ``obj`` on every rank (pickled; tensors should be on the CPU): through the
        ``queue`` when one is attached (rank 0 writes and goes on), else over gloo."""
        if self.world_size == 1:
            return obj
        if self.queue is None:
            obj = self._broadcast_gloo(obj)
        elif self.is_driver:
            self.queue.enqueue(obj, self._broadcast_gloo)
        else:
            obj = self.queue.dequeue(self._broadcast_gloo)
        op = obj[0] if isinstance(obj, tuple) and obj else type(obj).__name__
        self._record(f"broadcast_object:{op}")
        return obj

    def _broadcast_gloo(self, obj: object = None) -> object:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype), on the device."""
        if self.world_size > 1:
            self._record("broadcast_tensor", x)
            dist.broadcast(x, src=0)
        return x

    def _record(self, op: str, x: torch.Tensor | None = None) -> None:
        """One line of the trace (host-side only: safe inside a CUDA graph capture)."""
        if self.trace is None:
            return
        entry = {"op": op} if x is None else {"op": op, "shape": list(x.shape),
                                               "dtype": str(x.dtype).removeprefix("torch.")}
        self.trace.write(json.dumps(entry) + "\n")
        self.trace.flush()

    def abort(self) -> None:
        """Make collectives that wait for a dead peer fail instead of waiting (NCCL; gloo's fail
        by themselves when a peer's connection closes), and the push exchange's barriers return
        (``PushExchange.abort``: a host write, first, so a barrier spinning on the dead peer
        lets the stream reach NCCL's collectives). Blocks its caller (the driver's watcher
        thread) until the graphs that captured the group's collectives are released."""
        if not (self.connected and self.device.type == "cuda"):
            return
        exchange = self.exchange
        if exchange is not None:
            exchange.abort()
        with self.lock:
            backend = dist.distributed_c10d._get_default_group()._get_backend(self.device)
            abort = getattr(backend, "abort", None)
            if abort is not None:
                abort()

    def leave(self, synchronize: bool = False, timeout: float | None = None) -> bool:
        """Leave the process group alone, waiting for no peer (rank 0, once ranks 1..N-1 exited):
        after waiting for the device (``synchronize``; only when no collective can still be
        waiting for a peer), NCCL's communicators are aborted and gloo's group destroyed, in a
        daemon thread given ``timeout`` seconds (default ``RELEASE_TIMEOUT_S``). The CUDA graphs
        that captured the group's collectives must be gone first. False when the release failed
        or did not return: it is logged, and ``connect`` refuses while it is still running."""
        if not self.connected:
            return True
        held = [self.exchange]  # freed in ``release``: freeing symmetric memory synchronizes
        self._left()
        device = self.device

        def release() -> None:
            with self.lock:  # after an abort of the watcher's, never beside it
                if device.type == "cuda":  # a new thread starts on device 0
                    torch.cuda.set_device(device)
                    if synchronize:
                        torch.cuda.synchronize(device)
                _release_process_group(device.type)
                held.clear()

        seconds = RELEASE_TIMEOUT_S if timeout is None else timeout
        released, thread = run_bounded(release, seconds, "releasing the process group")
        if thread.is_alive():
            global _PENDING  # noqa: PLW0603 -- one release per process can be pending
            _PENDING = thread
            log.warning("tensor parallel: rank 0's process group was not released within %g s; "
                        "this process cannot start another tensor-parallel engine while it is "
                        "held", seconds)
        return released

    def _left(self) -> None:
        self.connected, self.cpu_group, self.exchange, self.last_ring = False, None, None, None
        if self.trace is not None:
            self.trace.close()
            self.trace = None


# a release of this process's process group that did not return in time (``TPGroup.leave``)
_PENDING: threading.Thread | None = None


def check_free() -> None:
    """Raise, naming why, if this process cannot join a new process group: an earlier group's
    release still runs, or a default process group exists that samebits did not release."""
    if _PENDING is not None and _PENDING.is_alive():
        raise RuntimeError(
            "tensor parallel: an earlier tensor-parallel engine's process group could not be "
            "released in this process (its NCCL abort or gloo destroy has not returned), so no "
            "new group can be formed here; start the engine in a new process")
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "tensor parallel: torch.distributed's default process group is already initialized "
            "in this process (by other code, or an engine that was not shut down or whose "
            "release failed); destroy it or start the engine in a new process")


def run_bounded(fn: Callable[[], object], seconds: float, name: str
                ) -> tuple[bool, threading.Thread]:
    """Run ``fn`` in a daemon thread for at most ``seconds``: (whether it returned without an
    exception in time -- an exception is logged --, the thread: still alive if it did not
    return; the process can exit without it)."""
    ok: list[bool] = []

    def target() -> None:
        try:
            fn()
            ok.append(True)
        except Exception as e:  # noqa: BLE001 -- reported; the caller goes on
            log.warning("tensor parallel: %s failed: %s: %s", name, type(e).__name__, e)

    thread = threading.Thread(target=target, name=f"samebits-tp-{name.replace(' ', '-')}",
                              daemon=True)
    thread.start()
    thread.join(seconds)
    return bool(ok), thread


def _open_trace(rank: int) -> TextIO | None:
    directory = env.tp_trace_dir()
    if directory is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    return open(directory / f"rank-{rank}.jsonl", "w", encoding="utf-8")  # noqa: SIM115


def _release_process_group(device_type: str) -> None:
    """Every process group of this process, released locally: on CUDA aborted (NCCL's abort waits
    for no peer), on CPU destroyed (gloo's destroy is local); either way torch.distributed has no
    default group afterwards, so a new one can be formed."""
    if not dist.is_initialized():
        return
    if device_type == "cuda" and hasattr(dist.distributed_c10d, "_abort_process_group"):
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()
