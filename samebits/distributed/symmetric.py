"""Row-parallel sums exchanged through torch's symmetric memory: push, then a device barrier.

Under tensor parallel a row-parallel layer (o_proj, down_proj) ends with every rank's fp32 [T, H]
sum of its own K segments stacked in rank order, [N, T, H], which the next norm adds in the rank
tree (``samebits.models.parallel.RowParallelLinear.gathered``). With ``SAMEBITS_TP_PUSH=1`` (or 2)
on CUDA a ``PushExchange`` builds that stack instead of NCCL's gather, with the same fp32 values in
the same slots -- so the same bits:

- Buffers: one symmetric-memory fp32 tensor per rank, [RINGS, N * max_rows * width] --
  ``RINGS * N * max_rows * width * 4`` bytes on each rank (logged at connect), where ``max_rows``
  is min(``PUSH_MAX_ROWS``, the engine's ``max_num_batched_tokens``) and ``width`` the widest
  row-parallel output (the hidden size): 128 MiB for two ranks of hidden size 4096 --,
  rendezvoused over the world group when the group connects (``open_exchange``); each rank maps
  its peers' tensors (torch's ``get_remote_tensor``). For an exchange of T rows of H values
  (T <= max_rows, H <= width), rank r's sum sits at [r T H, (r + 1) T H) of a ring, so the
  ring's first N T H values, viewed [N, T, H], are contiguous: the layout of NCCL's gather.
- One exchange on ring i, in each rank's stream order: the row-parallel GEMM writes this rank's
  sum straight into its slot of its own ring i (``linear_sum(..., out=slot)``); a copy of that
  slot into the same slot of every peer's ring i (a device-to-device copy through the peer
  mapping, over NVLink); the ranks' barrier (``samebits.ops.triton.rank_barrier``: one kernel
  on the current stream; it signals every peer with a release and waits for every peer's signal
  with an acquire, both at system scope, through an int32 flag per pair of ranks in a second
  symmetric-memory tensor, [N] on each rank); then the norm reads ring i as [N, T, H].
  Each peer issued its copy into this rank's ring i before its own barrier, so once this rank's
  barrier returns every peer's slot is written.
- ``SAMEBITS_TP_PUSH=2`` with two ranks (``PushExchange.fused``): no copy. The kernel that
  stores the sum (``linear_sum(..., out=slot, peer_out=peer_slot)``; ``peer_slot`` is the same
  slot of the peer's ring i, mapped here) stores each output tile into both, the same registers
  twice, so the transfer over NVLink runs while the GEMM's later tiles are computed; then the
  barrier. The kernel completes before the barrier kernel starts (stream order), whose signal is
  a release (as after the copy): the peer reads the stores after its own barrier returns, as it
  reads the copy's. More ranks, or level 1, copy.
- Why a ring of two: a rank's copy (or, fused, its GEMM's peer stores) into ring i for exchange
  e + 2 must not land while a peer still reads ring i for exchange e. The rank issues that copy
  or GEMM after its barrier of exchange e + 1 (the GEMM's programs store nothing before the
  previous kernel in the stream has finished, programmatic launch included), which returns only
  once every peer has reached its own barrier e + 1 -- that is, every peer's stream has run its
  norm of exchange e (GEMM -> push -> barrier -> norm reads, in order).
  With one buffer each exchange would need a second barrier after the reads. Layers take rings
  0, 1, 0, 1 in the order they are built (``TPGroup.reserve_push``), the order a forward runs them
  (o_proj then down_proj, layer by layer), and ``takes_push`` refuses, at run time, a push into
  the ring of the previous push when no NCCL gather or all-reduce (which every rank reaches only
  after its earlier reads) came between: that exchange takes the gather.

Two invariants the argument above relies on, stated here because nothing checks them at run
time (a change that breaks either races without an error):

- (a) Every kernel launched with programmatic dependent launch calls ``wait_for_inputs``
  (``samebits.ops.triton.launcher``) before any load or store of activations -- the GEMM that
  writes a slot (and, fused, the peer's), the norm that reads a ring, every kernel between. So a
  kernel's memory operations follow the completion of every earlier kernel in the stream, and
  completion is transitive: the barrier kernel's release covers the GEMM's and the copy's
  stores, and nothing after the barrier reads a ring before the barrier has returned.
- (b) Every reader of a pushed stack -- the next norm (``PendingRankSum`` summed in it),
  ``sum_tree``, the resolution of a pending sum where there is no residual yet
  (``samebits.ops.pending_rank_sum.resolved``) -- runs in this rank's stream before its next
  push barrier. A model that kept o_proj's stack (ring 0) unread while down_proj pushes (ring
  1) would race: once this rank's ring-1 barrier returns, a peer may push the next o_proj's sum
  into ring 0.

Every rank takes the same path for the same layer and step: ``takes_push`` reads the row count and
width (the same on every rank), the layer's ring (the same model on every rank), the ring of the
previous push (the same sequence of collectives on every rank) and whether the exchange exists
and whether it is fused (both agreed on by every rank at connect, ``open_exchange``: every CUDA
rank of several reports its ``SAMEBITS_TP_PUSH`` level and all take the smallest, so ranks whose
environments differ still take one path). The barrier and the copies are device
work on the current stream with no host value of the batch: a CUDA graph captures them. The ring
of each push is chosen on the host when the graph is captured, and a replay does not move
``last_ring``: this is safe because an engine forward begins with the vocab-parallel embedding's
NCCL gather and a replayed step's hidden states go next to the LM head's NCCL gather (each a
barrier for the rings), and the graphs of one step replay in the order they were captured.

A rank that dies mid-step leaves its peers' barriers waiting for a signal that never comes, and
NCCL's abort cannot stop a kernel that is not NCCL's. So the barrier also watches an abort word
of this exchange, an int32 in page-locked host memory the host writes directly
(``PushExchange.abort``, which ``TPGroup.abort`` calls before aborting NCCL): once it is set
every barrier of the exchange returns within a few spins, and the stream runs on to NCCL's
collectives, which NCCL's abort ends. Invariant: the word is set only to abandon the group;
what a forward computes after it is garbage, and the engine's guard reports the dead rank
instead of a result (``samebits.engine.executor.Ranks.guard``). A new connect opens a new
exchange, with new flags and a word that is clear. The barrier has no timeout of its own: the
driver watches the ranks from before it connects, and the group holds the exchange from its
probe on, so a peer that dies during the probe sets the word too.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from samebits import env

log = logging.getLogger("samebits.engine")

RINGS = 2  # buffers alternated between consecutive row-parallel layers (module docstring)
# set once this process has entered torch's symmetric-memory rendezvous. Torch keys the store
# exchanges of a rendezvous with a count kept per process (its ``StoreExchange``), so a process
# that rendezvoused before -- rank 0 of an earlier engine, the caller's process -- and a newly
# spawned rank would wait for each other's keys forever; every later engine of this process
# gathers instead (``wanted``: the same bits)
_RENDEZVOUSED = threading.Event()
# the most rows an exchange pushes (the default max_num_batched_tokens: every step of the default
# engine); an engine of fewer batched tokens reserves only those (``push_rows``); more rows take
# NCCL's gather
PUSH_MAX_ROWS = 2048
# the oldest torch whose symmetric-memory API (``empty_strided_p2p``, ``rendezvous`` over a group
# name, ``get_remote_tensor``) this module is written against; older ones take NCCL's gather
MIN_TORCH = (2, 6)


class PushExchange:
    """A rank's symmetric buffers and its peers' (module docstring). ``local``: this rank's
    [RINGS, N * max_rows * width] fp32 tensor; ``peers``: every other rank's, mapped here, by
    rank; ``barrier``: a device-side barrier of every rank on the current stream; ``handle``:
    whatever keeps the mappings alive (torch's symmetric-memory handles); ``fused``: the kernel
    that writes this rank's slot also writes it into the one peer's (``peer_slot``), and
    ``exchange`` copies nothing; ``abort_word``: the int32 [1] the barrier watches (module
    docstring; None where the barrier watches none)."""

    def __init__(self, local: torch.Tensor, peers: dict[int, torch.Tensor],
                 barrier: Callable[[], None], rank: int, width: int,
                 max_rows: int = PUSH_MAX_ROWS, handle: object = None,
                 fused: bool = False, abort_word: torch.Tensor | None = None) -> None:
        world = len(peers) + 1
        if local.shape != (RINGS, world * max_rows * width) or local.dtype != torch.float32:
            raise ValueError(f"PushExchange: local buffer {tuple(local.shape)} {local.dtype}, "
                             f"expected ({RINGS}, {world * max_rows * width}) float32")
        if sorted(peers) != [r for r in range(world) if r != rank]:
            raise ValueError(f"PushExchange: rank {rank}'s peers are {sorted(peers)}")
        if fused and world != 2:
            raise ValueError(f"PushExchange: a fused exchange has one peer, not {world - 1}")
        self.local, self.peers, self.barrier, self.handle = local, peers, barrier, handle
        self.rank, self.world_size, self.width, self.max_rows = rank, world, width, max_rows
        self.fused, self.abort_word = fused, abort_word

    def abort(self) -> None:
        """Make every barrier of this exchange return within a few spins, the one spinning now
        and every later one (a rank died; module docstring): a host write to the abort word,
        which no stream operation waits behind. The exchange is not used again."""
        if self.abort_word is not None:
            self.abort_word.fill_(1)

    def fits(self, rows: int, width: int) -> bool:
        """Whether an exchange of ``rows`` x ``width`` fp32 values fits a ring."""
        return 0 < rows <= self.max_rows and 0 < width <= self.width

    def _slot_in(self, buffer: torch.Tensor, ring: int, rows: int, width: int) -> torch.Tensor:
        """This rank's [rows * width] slot of ring ``ring`` in ``buffer`` (its own or a peer's:
        the same offsets)."""
        n = rows * width
        return buffer[ring, self.rank * n:(self.rank + 1) * n]

    def slot(self, ring: int, rows: int, width: int) -> torch.Tensor:
        """This rank's [rows * width] slot of its own ring ``ring``: where its sum is written."""
        return self._slot_in(self.local, ring, rows, width)

    def peer_slot(self, ring: int, rows: int, width: int) -> torch.Tensor | None:
        """Where ``fused``: the peer's [rows * width] slot of its ring ``ring`` for this rank's
        sum (``slot``'s offset in the peer's buffer, mapped here), for the kernel that writes
        ``slot`` to write too; else None."""
        if not self.fused:
            return None
        (buffer,) = self.peers.values()
        return self._slot_in(buffer, ring, rows, width)

    def exchange(self, ring: int, rows: int, width: int) -> torch.Tensor:
        """[N, rows, width]: this rank's slot (written; and where ``fused`` the peer's slot
        too) copied into every peer's same slot unless ``fused``, then the barrier; every rank's
        sum in rank order, in this rank's ring ``ring``."""
        mine = self.slot(ring, rows, width)
        for buffer in () if self.fused else self.peers.values():
            self._slot_in(buffer, ring, rows, width).copy_(mine)
        self.barrier()
        n = rows * width
        return self.local[ring, :self.world_size * n].view(self.world_size, rows, width)

    def probe(self) -> bool:
        """One exchange of one row on each ring, rank r sending r + 1: whether every rank's
        value arrived in its slot (a mapping to the wrong place fails here, not in a step)."""
        ranks = torch.arange(1, self.world_size + 1, dtype=torch.float32,
                             device=self.local.device)
        want = ranks.view(-1, 1, 1).expand(self.world_size, 1, self.width)
        ok = True
        for ring in range(RINGS):
            for slot in (self.slot(ring, 1, self.width), self.peer_slot(ring, 1, self.width)):
                if slot is not None:  # fused: written here, as the kernel writes it
                    slot.fill_(self.rank + 1.0)
            ok = torch.equal(self.exchange(ring, 1, self.width), want) and ok
        return ok


def takes_push(exchange: PushExchange | None, ring: int, last_ring: int | None, rows: int,
               width: int) -> bool:
    """Whether a row-parallel layer of ring ``ring`` pushes ``rows`` x ``width`` (else NCCL
    gathers): an exchange exists, the rows fit a ring, and the previous push since the last NCCL
    gather or all-reduce (``last_ring``; None: none) used the other ring."""
    return exchange is not None and exchange.fits(rows, width) and ring != last_ring


def fuses(level: int, world_size: int) -> bool:
    """Whether an exchange is ``fused`` (the GEMM writes the peer's slot too): the level every
    rank agreed on (``open_exchange``) is 2 and there are two ranks."""
    return level >= 2 and world_size == 2


def torch_supports(version: str = torch.__version__) -> bool:
    """Whether ``version`` of torch has the symmetric-memory API this module calls
    (``MIN_TORCH``)."""
    return TorchVersion(version) >= MIN_TORCH


def wanted(width: int, world_size: int) -> int:
    """The push level this rank asks for at connect (0: none): ``SAMEBITS_TP_PUSH`` (by default
    2 for two ranks -- the fused push, GPU-tested on two ranks -- and 0 for more) where a
    row-parallel layer pushes (``width`` > 0), torch is at least ``MIN_TORCH`` and this process
    has not rendezvoused before (``_RENDEZVOUSED``; else logged).
    Every CUDA rank of several reports it to the agreement (``open_exchange``), whatever it is,
    so ranks whose environments differ still take one path."""
    asked, default = env.tp_push(), 2 if world_size == 2 else 0
    level = (default if asked is None else asked) if width > 0 else 0
    say = log.info if asked is None else log.warning  # the default, or asked for
    if level and _RENDEZVOUSED.is_set():
        say("tensor parallel: an earlier engine of this process entered torch's symmetric-"
            "memory rendezvous, which cannot be repeated with newly spawned ranks; the "
            "row-parallel sums take NCCL's gather (the same bits)")
        return 0
    if level and not torch_supports():
        say("tensor parallel: the push exchange (SAMEBITS_TP_PUSH) needs torch >= %d.%d (its "
            "symmetric-memory API), this is %s; the row-parallel sums take NCCL's gather",
            *MIN_TORCH, torch.__version__)
        return 0
    return level


def push_rows(max_batched_tokens: int | None) -> int:
    """The rows a ring holds: ``PUSH_MAX_ROWS``, or the engine's ``max_num_batched_tokens``
    (the most rows a forward has) where fewer."""
    return PUSH_MAX_ROWS if max_batched_tokens is None else min(PUSH_MAX_ROWS, max_batched_tokens)


class Group(Protocol):
    """What opening an exchange needs of the process group (``TPGroup``): its device, this
    rank, the world size, and the smallest of every rank's int (a collective)."""

    device: torch.device
    rank: int
    world_size: int
    exchange: PushExchange | None  # set once probing: the group's abort ends its barriers

    def min_int(self, value: int) -> int: ...


def open_exchange(group: Group, width: int, max_rows: int = PUSH_MAX_ROWS
                  ) -> PushExchange | None:
    """The group's exchange for up to ``max_rows`` rows of up to ``width`` values,
    ``RINGS * N * max_rows * width * 4`` bytes of device memory on each rank (logged), allocated,
    rendezvoused and probed; None on every rank (logged) unless every rank has one. On CUDA
    with several ranks every rank first agrees on the level (``min_int`` of each rank's
    ``wanted``: 0 where any rank asks for none), so no rank skips an agreement its peers wait
    in; on CPU, or one rank, every rank returns at once and issues nothing. The ranks agree
    again after allocating (the barrier's flags zeroed and the device synchronized first, so no
    peer's signal lands before the zeroing), so no rank enters the rendezvous alone, and after
    the rendezvous, so no rank probes alone; a probe that raises on any rank (torch's or
    Triton's API differs) makes every rank gather, one that returns wrong values on any rank
    raises on every rank."""
    if group.device.type != "cuda" or group.world_size == 1:
        return None
    level = group.min_int(wanted(width, group.world_size))
    if level == 0:
        return None
    local = _symmetric_empty((RINGS, group.world_size * max_rows * width), group.device)
    flags = _symmetric_empty((group.world_size,), group.device, torch.int32)
    if flags is not None:
        flags.zero_()
        if flags.is_cuda:
            torch.cuda.synchronize(flags.device)
    if group.min_int(int(local is not None and flags is not None)) == 0:
        return None
    log.info("tensor parallel: rank %d's push buffers: %d bytes (%d rings x %d ranks x %d rows x "
             "%d fp32)", group.rank, local.numel() * local.element_size(), RINGS,
             group.world_size, max_rows, width)
    exchange = _rendezvous(local, flags, group.rank, group.world_size, width, level, max_rows)
    if group.min_int(int(exchange is not None)) == 0:
        return None
    group.exchange = exchange  # what ``abort`` ends, from the probe's barriers on
    verdict = group.min_int(_probed(exchange))
    if verdict == PROBE_RAISED:
        return None
    if verdict == PROBE_WRONG:
        raise RuntimeError(f"tensor parallel: rank {group.rank}'s symmetric-memory push probe "
                           "did not deliver every rank's value to its slot")
    return exchange


PROBE_RAISED, PROBE_WRONG, PROBE_OK = 0, 1, 2  # ``_probed``'s verdicts, agreed on by their min


def _probed(exchange: PushExchange) -> int:
    """``exchange.probe()``'s verdict: ``PROBE_OK`` where every value arrived, ``PROBE_WRONG``
    where one did not, ``PROBE_RAISED`` (logged) where the probe raised -- torch's or Triton's
    API is not the one this module calls (Triton's launcher refusing the abort word's host
    address, say): every rank then gathers. The ranks share one torch and one Triton, so an API
    that raises raises on each before any of them launches a barrier kernel that would wait for
    it."""
    try:
        return PROBE_OK if exchange.probe() else PROBE_WRONG
    except Exception as e:  # noqa: BLE001 -- reported; every rank then gathers
        log.warning("tensor parallel: the symmetric-memory push probe raised (%s: %s); the "
                    "row-parallel sums take NCCL's gather", type(e).__name__, e)
        return PROBE_RAISED


def _symmetric_empty(shape: tuple[int, ...], device: torch.device,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """A contiguous tensor of torch's symmetric memory on ``device``, an allocation of its own; None
    (logged) where torch cannot allocate one. NVLink multicast stays off
    (``env.keep_torch_multicast_off``). Not from torch's symmetric-memory pool (where
    ``symm_mem.empty`` allocates): torch caches a rendezvous per allocation and group name, and a
    pooled allocation outlives its tensor, so a later group of the same name (a second engine in
    this process) would be handed the first group's mappings; this one is released with its
    tensor."""
    try:
        from torch._C._distributed_c10d import _SymmetricMemory
        env.keep_torch_multicast_off()
        strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return _SymmetricMemory.empty_strided_p2p(shape, strides, dtype, device)
    except Exception as e:  # noqa: BLE001 -- reported; every rank then gathers
        log.warning("tensor parallel: no symmetric memory (%s: %s); the row-parallel sums take "
                    "NCCL's gather", type(e).__name__, e)
        return None


def _rendezvous(local: torch.Tensor, flags: torch.Tensor, rank: int, world: int, width: int,
                level: int, max_rows: int = PUSH_MAX_ROWS) -> PushExchange | None:
    """``local`` and the barrier's ``flags`` rendezvoused over the world group (in that order on
    every rank) and every rank's tensors mapped, fused where the agreed ``level`` fuses; None
    (logged) where that fails, this rank's own mapping of either is not the tensor itself, or
    the barrier cannot be built."""
    try:
        from torch.distributed import _symmetric_memory as symm_mem
        name = dist.group.WORLD.group_name
        _RENDEZVOUSED.set()
        handles = (symm_mem.rendezvous(local, name), symm_mem.rendezvous(flags, name))
        mapped = {r: _mapped(handles[0], r, local) for r in range(world)}
        flag_buffers = [_mapped(handles[1], r, flags) for r in range(world)]
        if mapped[rank].data_ptr() != local.data_ptr() or \
                flag_buffers[rank].data_ptr() != flags.data_ptr():
            raise RuntimeError("this rank's mapping is not its own tensor")
        barrier, abort_word = _device_barrier(flags, flag_buffers, rank)
    except Exception as e:  # noqa: BLE001 -- reported; every rank then gathers
        log.warning("tensor parallel: symmetric memory rendezvous failed (%s: %s); the "
                    "row-parallel sums take NCCL's gather", type(e).__name__, e)
        return None
    peers = {r: t for r, t in mapped.items() if r != rank}
    return PushExchange(local, peers, barrier, rank, width, max_rows, handle=handles,
                        fused=fuses(level, world), abort_word=abort_word)


def _device_barrier(flags: torch.Tensor, buffers: list[torch.Tensor], rank: int
                    ) -> tuple[Callable[[], None], torch.Tensor]:
    """Rank ``rank``'s barrier over every rank's flag buffer (``buffers``, mapped here, in rank
    order; ``flags`` its own) and the abort word it watches: a clear int32 in page-locked host
    memory (``samebits.ops.triton.rank_barrier``)."""
    from samebits.ops.triton.rank_barrier import rank_barrier
    addresses = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64,
                             device=flags.device)
    abort_word = torch.zeros(1, dtype=torch.int32, pin_memory=flags.is_cuda)
    return functools.partial(rank_barrier, flags, addresses, abort_word, rank), abort_word


def _mapped(handle, rank: int, like: torch.Tensor) -> torch.Tensor:
    """Rank ``rank``'s tensor rendezvoused as ``like``, mapped on this device: torch's
    ``get_remote_tensor`` (the tensor's own offset in its allocation), else ``get_buffer`` at
    the allocation's start (torch versions without it)."""
    remote = getattr(handle, "get_remote_tensor", None)
    if remote is not None:
        return remote(rank, tuple(like.shape), like.dtype)
    return handle.get_buffer(rank, tuple(like.shape), like.dtype)
