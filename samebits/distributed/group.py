"""The tensor-parallel process group and its collectives (gloo on CPU, NCCL on CUDA).

Only gathers: ``ordered_sum`` all-gathers every rank's per-segment partials and adds them in
segment order on every rank, so the sum is the same fp32 sequence as on one device; ``gather_cat``
all-gathers row blocks and concatenates them in rank order. No reduction order depends on N.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from samebits.ops.backend import ordered_sum


class TPGroup:
    def __init__(self, rank: int, world_size: int, device: torch.device,
                 init_method: str | None = None) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        if world_size > 1:
            if device.type == "cuda":  # NCCL's objects and buffers live on the current device
                torch.cuda.set_device(device)
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=init_method, rank=rank,
                                    world_size=world_size)

    def ordered_sum(self, partials: list[torch.Tensor]) -> torch.Tensor:
        """``((p_0 + p_1) + p_2) + ...`` over all S segments (this rank's are ``partials``, its
        segments in order; rank r holds segments r S/N ...), in the partials' dtype (the
        backend's accumulation dtype), on every rank: ``samebits.ops.backend.ordered_sum``."""
        return ordered_sum(self.all_gather(torch.stack(partials)))

    def gather_cat(self, local: torch.Tensor, sizes: list[int], dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``local`` along ``dim`` in rank order; rank r's block has
        ``sizes[r]`` entries along ``dim`` (blocks are padded to the largest for the gather)."""
        if self.world_size == 1:
            return local
        dim = dim % local.dim()
        width = max(sizes)
        pad = list(local.shape)
        pad[dim] = width - local.shape[dim]
        padded = torch.cat([local, local.new_zeros(pad)], dim=dim)
        blocks = self.all_gather(padded.unsqueeze(0))
        return torch.cat([blocks[r].narrow(dim, 0, sizes[r]) for r in range(self.world_size)],
                         dim=dim)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[k, ...] per rank -> [N k, ...] in rank order."""
        if self.world_size == 1:
            return x
        out = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(out, x.contiguous())
        return torch.cat(out)

    def broadcast(self, obj: object) -> object:
        """Rank 0's ``obj`` on every rank (pickled; tensors should be on the CPU)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
