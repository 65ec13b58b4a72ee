"""The tensor-parallel process group and its collectives (gloo on CPU, NCCL on CUDA).

A ``TPGroup`` names this process's rank and the world size from construction (a model's layers
are sized from them before any process group exists); ``connect`` joins the process group.
With one rank there is no process group and every collective is the identity.

The invariant arithmetic uses only gathers: ``all_gather`` of per-segment partials (added in
segment order by the caller, the same fp32 sequence as on one device) and ``gather_cat`` of row
blocks in rank order; no reduction order depends on N. ``all_reduce_sum`` (an all-reduce, whose
order is the library's) serves only the standard mode. Control messages (``broadcast_object``,
``min_int``) run over a gloo group on every device, so they never wait behind device work.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

# a collective waits this long for its peers: long enough for a rank that loads or compiles
# slower than the others; a dead peer is noticed by the driver's watcher, not by this timeout
TIMEOUT = datetime.timedelta(minutes=30)


class TPGroup:
    def __init__(self, rank: int = 0, world_size: int = 1,
                 device: torch.device | str = "cpu") -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.cpu_group = None  # gloo group for control messages (the default group on CPU)
        self.connected = False

    def connect(self, init_method: str) -> None:
        """Join the process group (every rank calls this with the same ``init_method``)."""
        if self.world_size == 1 or self.connected:
            return
        cuda = self.device.type == "cuda"
        if cuda:  # NCCL's objects and buffers live on the current device
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method,
                                rank=self.rank, world_size=self.world_size, timeout=TIMEOUT)
        self.cpu_group = dist.new_group(backend="gloo", timeout=TIMEOUT) if cuda else None
        self.connected = True

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[k, ...] per rank -> [N k, ...] in rank order."""
        if self.world_size == 1:
            return x
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype,
                          device=x.device)
        dist.all_gather_single(out, x.contiguous())
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
            dist.all_reduce(x)
        return x

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (the KV blocks every rank can hold)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's ``obj`` on every rank (pickled; tensors should be on the CPU)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype), on the device."""
        if self.world_size > 1:
            dist.broadcast(x, src=0)
        return x

    def abort(self) -> None:
        """Make collectives that wait for a dead peer fail instead of waiting (NCCL); gloo's
        fail by themselves when a peer's connection closes."""
        if not (self.connected and self.device.type == "cuda"):
            return
        backend = dist.distributed_c10d._get_default_group()._get_backend(self.device)
        abort = getattr(backend, "abort", None)
        if abort is not None:
            abort()

    def close(self) -> None:
        if self.connected and dist.is_initialized():
            dist.destroy_process_group()
        self.connected = False
