"""A device-side barrier of the tensor-parallel ranks that the host can abort.

``rank_barrier(flags, peers, abort, rank)`` launches one program of one warp on the current
stream. It returns once every other rank has launched its own barrier of the same count (the
barrier of the push exchange, ``samebits.distributed.symmetric``), or as soon as the host has set
the abort word, whichever comes first.

The flags: every rank holds an int32 [N] buffer in memory every rank maps (torch's symmetric
memory), zero at the start; ``flags[p]`` is 1 while rank p's signal to this rank is not yet
consumed. ``peers`` is an int64 [N] device tensor of every rank's flag buffer's address as
mapped on this device. The kernel, for each peer p in turn, signals it -- a compare-and-swap of
p's ``flags[rank]`` from 0 to 1 with release semantics at system scope, retried while it reads 1
(p has not consumed this rank's previous signal) --, then waits for each peer's signal -- a
compare-and-swap of its own ``flags[p]`` from 1 to 0 with acquire semantics at system scope,
retried until it reads 1. Each flag goes 0 -> 1 -> 0 once per barrier, so the next barrier
starts from zero. Release and acquire pair up as in torch's symmetric-memory ``barrier`` (whose
protocol this is): the stores this rank's stream made before the barrier (the kernels before it
have completed) are visible to a peer once its barrier has returned.

The abort word: an int32 in page-locked host memory (``torch.empty(..., pin_memory=True)``: torch
allocates it with ``cudaHostAlloc``, which under unified addressing -- every 64-bit Linux CUDA
platform -- is mapped into every device's address space; Triton's launcher translates the
tensor's address with ``cuPointerGetAttribute``, and refuses memory that is not mapped). The
host writes it directly, so a write reaches the kernel while the stream is stuck behind it (a
stream operation would queue behind the spin). While spinning the kernel reads it every
``POLL`` retries with a volatile load (no cache: a CUDA graph's replay reads it afresh), and
once it is non-zero returns without waiting further. Invariant: the word is set only to abandon
the group (a rank died); once set, every barrier of that group returns within ``POLL`` spins,
and what the stream computes afterwards is garbage that nothing may read as a result. The flags
are then in no defined state: a group is never used again after its abort (a new connect
allocates new flags and a new word).

Launched with programmatic dependent launch under ``launcher.as_captured`` (``wait_for_inputs``
first: the previous kernel has completed and its stores are visible before the release).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from samebits.ops.triton.launcher import Launcher, aligned, programmatic, wait_for_inputs

# spins between two reads of the abort word: a read crosses PCIe to host memory (about a
# microsecond), a spin an NVLink round trip; an abort is seen within POLL spins
POLL = 64


@triton.jit
def _aborted(abort_ptr, spins, POLL: tl.constexpr):
    """The abort word on every ``POLL``-th spin, else 0 (no read)."""
    if spins % POLL == POLL - 1:
        word = tl.load(abort_ptr, volatile=True)
    else:
        word = tl.zeros((), dtype=tl.int32)
    return word


@triton.jit
def _rank_barrier_kernel(flags_ptr, peers_ptr, abort_ptr, RANK: tl.constexpr,
                         WORLD: tl.constexpr, POLL: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    aborted = tl.zeros((), dtype=tl.int32)
    for i in tl.static_range(1, WORLD):  # signal every peer: its flags[RANK] 0 -> 1
        peer = tl.load(peers_ptr + (RANK + i) % WORLD).to(tl.pointer_type(tl.int32))
        spins = 0
        while (tl.atomic_cas(peer + RANK, 0, 1, sem="release", scope="sys") != 0) & \
                (aborted == 0):
            aborted = _aborted(abort_ptr, spins, POLL)
            spins += 1
    for i in tl.static_range(1, WORLD):  # wait for every peer's signal: flags[p] 1 -> 0
        spins = 0
        while (tl.atomic_cas(flags_ptr + (RANK + i) % WORLD, 1, 0, sem="acquire",
                             scope="sys") != 1) & (aborted == 0):
            aborted = _aborted(abort_ptr, spins, POLL)
            spins += 1


_BARRIER = Launcher(_rank_barrier_kernel)


def rank_barrier(flags: torch.Tensor, peers: torch.Tensor, abort: torch.Tensor,
                 rank: int) -> None:
    """Launch the barrier of ``rank`` (module docstring): ``flags`` its int32 [N] flag buffer,
    ``peers`` int64 [N] every rank's flag buffer's address mapped here, ``abort`` an int32 [1]
    word the host sets to abandon the group (page-locked host memory on CUDA)."""
    world = flags.numel()
    if flags.dtype != torch.int32 or peers.dtype != torch.int64 or peers.numel() != world \
            or abort.dtype != torch.int32 or abort.numel() != 1 or not 0 <= rank < world:
        raise ValueError(f"rank_barrier: flags {flags.dtype}[{world}], peers {peers.dtype}"
                         f"[{peers.numel()}], abort {abort.dtype}[{abort.numel()}], rank {rank}; "
                         "expected int32[N], int64[N], int32[1] and a rank below N")
    pdl = programmatic(flags)
    key = (rank, world, pdl, aligned(flags, peers, abort))
    _BARRIER(key, (1, 1, 1), flags, peers, abort, rank, world, POLL, pdl, num_warps=1,
             launch_pdl=pdl)
