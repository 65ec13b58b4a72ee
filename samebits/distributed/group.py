"""The tensor-parallel process group and its collectives (gloo on CPU, NCCL on CUDA).

A ``TPGroup`` names this process's rank and the world size from construction (a model's layers
are sized from them before any process group exists); ``connect`` joins the process group.
With one rank there is no process group and every collective is the identity.

The invariant arithmetic uses only gathers: ``all_gather`` of per-segment partials (added in
segment order by the caller, the same fp32 sequence as on one device) and ``gather_cat`` of row
blocks in rank order; no reduction order depends on N. ``all_reduce_sum`` (an all-reduce, whose
order is the library's) serves only the standard mode. Control messages (``broadcast_object``,
``min_int``) run over a gloo group on every device, so they never wait behind device work.

Leaving the group (``close``) is collective on CUDA: NCCL's finalize and destroy wait until every
rank of the node calls them. So the ranks of a healthy group close at the same time (rank 0 does
not wait for the others to exit first); a rank whose peers died or are mid-call aborts instead
(``discard``), which waits for no one. With ``SAMEBITS_TP_TRACE`` set, each rank writes the
collectives it issues, in order (``_record``): ranks that would wait for each other show where
their sequences part.
"""

from __future__ import annotations

import datetime
import json
import threading
from typing import TextIO

import torch
import torch.distributed as dist

from samebits import env

# a collective waits this long for its peers: long enough for a rank that loads or compiles
# slower than the others; a dead peer is noticed by the driver's watcher, not by this timeout
TIMEOUT = datetime.timedelta(minutes=30)
CLOSE_TIMEOUT_S = 30.0  # how long ``close`` waits for the other ranks to close with it
DISCARD_WAIT_S = 5.0  # how long ``discard`` lets a failing ``close`` finish first


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
        self.closer: threading.Thread | None = None  # the thread of ``close``, once started
        self.trace: TextIO | None = None  # SAMEBITS_TP_TRACE: this rank's collectives, in order

    def connect(self, init_method: str) -> None:
        """Join the process group (every rank calls this with the same ``init_method``), then
        check it: a gather on the device and a reduction over the control group, so both
        backends have connected here (NCCL's communicator too, before any forward or graph
        capture) and a wrong device or a broken transport fails now, not in a step."""
        if self.world_size == 1 or self.connected:
            return
        cuda = self.device.type == "cuda"
        if cuda:  # NCCL's objects and buffers live on the current device
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method,
                                rank=self.rank, world_size=self.world_size, timeout=TIMEOUT)
        self.connected = True  # from here on, leaving needs ``close`` or ``discard``
        self.trace = _open_trace(self.rank)
        self.cpu_group = dist.new_group(backend="gloo", timeout=TIMEOUT) if cuda else None
        ranks = self.all_gather(torch.tensor([self.rank], device=self.device)).tolist()
        if ranks != list(range(self.world_size)) or self.min_int(self.rank) != 0:
            raise RuntimeError(f"tensor-parallel group check failed on rank {self.rank}: the "
                               f"ranks gathered {ranks}")

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
        """Rank 0's ``obj`` on every rank (pickled; tensors should be on the CPU)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        op = box[0][0] if isinstance(box[0], tuple) and box[0] else type(box[0]).__name__
        self._record(f"broadcast_object:{op}")
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
        """Make collectives that wait for a dead peer fail instead of waiting (NCCL); gloo's
        fail by themselves when a peer's connection closes."""
        if not (self.connected and self.device.type == "cuda"):
            return
        backend = dist.distributed_c10d._get_default_group()._get_backend(self.device)
        abort = getattr(backend, "abort", None)
        if abort is not None:
            abort()

    def close(self, timeout: float | None = None) -> bool:
        """Leave the process group together with the other ranks, each calling this at about
        the same time (after their last collective); False when that failed or did not finish
        within ``timeout`` seconds (default ``CLOSE_TIMEOUT_S``): then stop the ranks that did
        not close, and ``discard``."""
        if not self.connected:
            return True
        outcome: list[bool] = []

        def destroy() -> None:
            try:
                if self.device.type == "cuda":  # a new thread starts on device 0
                    torch.cuda.set_device(self.device)
                _destroy_process_group()
                outcome.append(True)
            except Exception:  # noqa: BLE001 -- reported as not closed; the caller discards
                outcome.append(False)

        self.closer = threading.Thread(target=destroy, name="samebits-tp-close", daemon=True)
        self.closer.start()
        self.closer.join(CLOSE_TIMEOUT_S if timeout is None else timeout)
        if outcome == [True]:
            self._left()
        return not self.connected

    def discard(self) -> None:
        """Leave the process group alone, without the other ranks (they died or were stopped):
        NCCL's communicators are aborted, which waits for no peer; gloo's close locally."""
        if not self.connected:
            return
        if self.closer is not None:  # a close that waited for a stopped rank fails now
            self.closer.join(DISCARD_WAIT_S)
        self._left()
        if not dist.is_initialized():
            return
        if self.device.type == "cuda" and hasattr(dist.distributed_c10d, "_abort_process_group"):
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()

    def _left(self) -> None:
        self.connected = False
        if self.trace is not None:
            self.trace.close()
            self.trace = None


def _open_trace(rank: int) -> TextIO | None:
    directory = env.tp_trace_dir()
    if directory is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    return open(directory / f"rank-{rank}.jsonl", "w", encoding="utf-8")  # noqa: SIM115


def _destroy_process_group() -> None:
    """Every process group of this process, destroyed (NCCL: finalize, then destroy, both
    collective over the node's ranks)."""
    if dist.is_initialized():
        dist.destroy_process_group()
