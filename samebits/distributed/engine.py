"""Tensor parallelism inside the engine: rank 0 (the engine's process) drives, ranks 1..N-1 are
spawned worker processes that load the same model, keep their own KV heads, and run every forward
and logits call rank 0 runs, in the same order (rank 0 broadcasts each call's inputs first).

``enable_tensor_parallel(runner, loaded, config)`` swaps the runner's model for the driver and its
KV caches for this rank's per-group caches. The engine's fingerprint does not change: the
single-device model already computes the segmented arithmetic, the same for every N. Every rank
keeps its full model: ``LLM.update_weights`` writes it (rank 0 first, which checks the tensors;
then each worker) and each rank re-copies its shards from it.
"""

from __future__ import annotations

import atexit
import dataclasses
import socket
import weakref
from typing import Any

import torch
import torch.multiprocessing as mp

from samebits.config import EngineConfig
from samebits.distributed.group import TPGroup
from samebits.distributed.model import TPModel
from samebits.distributed.segments import Segments
from samebits.models.weights import update_weights
from samebits.ops.backend import AttentionMetadata


def _device(config: EngineConfig, rank: int) -> str:
    dev = config.torch_device
    return f"cuda:{rank}" if dev.type == "cuda" else "cpu"


def _to(obj: Any, device: torch.device | str) -> Any:
    """Tensors inside tuples / AttentionMetadata moved to ``device`` (the plan dropped)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to(x, device) for x in obj)
    if isinstance(obj, AttentionMetadata):
        fields = {f.name: _to(getattr(obj, f.name), device) for f in dataclasses.fields(obj)
                  if f.name != "plan"}
        return AttentionMetadata(**fields)
    return obj


class TPDriver:
    """Rank 0's model, as the runner sees it: ``model(ids, pos, caches, meta)``, ``.ops``,
    ``compute_logits``; every call is mirrored on the workers."""

    def __init__(self, tp: TPModel, full, group: TPGroup, workers: list) -> None:
        self.tp, self.full, self.group, self.workers = tp, full, group, workers
        self.ops, self.cfg = tp.ops, tp.cfg
        self._closed = False

    def _send(self, kind: str, payload: Any) -> None:
        if self.group.world_size > 1:
            self.group.broadcast((kind, _to(payload, "cpu")))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list,
                 meta: AttentionMetadata) -> torch.Tensor:
        self._send("forward", (input_ids, positions, meta))
        return self.tp.forward(input_ids, positions, caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._send("logits", hidden)
        return self.tp.compute_logits(hidden)

    def weights_updated(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """After ``update_weights(full, items)`` on rank 0 (checked there, all or nothing): every
        worker applies the same items to its full model, and every rank re-copies its shards."""
        self._send("update", [(name, t.detach().cpu()) for name, t in items])
        self.tp.refresh(self.full)

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._send("stop", None)
        for w in self.workers:
            w.join(60)
            if w.is_alive():
                w.kill()
        self.group.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def enable_tensor_parallel(runner, loaded, config: EngineConfig) -> None:
    """Shard ``runner``'s model over ``config.tensor_parallel_size`` ranks (this process is rank
    0)."""
    world = config.tensor_parallel_size
    if loaded.model_config.moe is not None:
        raise ValueError(f"tensor_parallel_size={world}: {loaded.model_config.architecture} "
                         "(mixture of experts) runs on one device only")
    Segments.for_model(loaded.model_config, 0, world)  # N must divide S: fail before spawning
    init = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=_worker_main, daemon=True, name=f"samebits-tp-{r}",
                           args=(config, r, init, runner.num_blocks + 1,
                                 torch.get_num_threads()))
               for r in range(1, world)]
    for w in workers:
        w.start()
    group = TPGroup(0, world, runner.device, init)
    tp = TPModel(loaded.model, group)
    driver = TPDriver(tp, loaded.model, group, workers)
    runner.model, runner.graphs = driver, None
    runner.kv_caches = tp.allocate_caches(runner.num_blocks + 1, config.block_size)
    weakref.finalize(runner, driver.close)
    atexit.register(driver.close)


def shutdown(llm) -> None:
    """Stop an ``LLM``'s tensor-parallel workers (also done at exit)."""
    model = llm.engine.runner.model
    if isinstance(model, TPDriver):
        model.close()


def _worker_main(config: EngineConfig, rank: int, init: str, num_blocks: int,
                 threads: int) -> None:
    from samebits.loader import load
    torch.set_num_threads(threads)
    config = dataclasses.replace(config, device=_device(config, rank))
    loaded = load(config)
    group = TPGroup(rank, config.tensor_parallel_size, config.torch_device, init)
    full = loaded.model  # kept: weight updates are applied to it, then re-sharded
    tp = TPModel(full, group)
    del loaded
    caches = tp.allocate_caches(num_blocks, config.block_size)
    dev = config.torch_device
    with torch.inference_mode():
        while True:
            try:
                kind, payload = group.broadcast(None)
            except RuntimeError:  # rank 0 went away without a stop (killed): nothing to serve
                return
            if kind == "stop":
                break
            if kind == "forward":
                ids, pos, meta = _to(payload, dev)
                tp.forward(ids, pos, caches, tp.ops.plan_attention(meta))
            elif kind == "update":
                _apply_update(full, tp, payload)
            else:
                tp.compute_logits(_to(payload, dev))
    group.close()


def _apply_update(full, tp: TPModel, items: list[tuple[str, torch.Tensor]]) -> None:
    """A worker's side of ``TPDriver.weights_updated``: rank 0 checked the items already."""
    update_weights(full, items)
    hook = getattr(full.ops, "weights_updated", None)
    if hook is not None:
        hook(full)
    tp.refresh(full)
