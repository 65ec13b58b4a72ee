"""How many bytes a rank's KV cache gets (``gpu_memory_utilization``, vLLM's meaning, per rank).

On CUDA: the share ``gpu_memory_utilization`` of the device's total memory, less everything in
use now (this rank's weights, other processes) and the activations the runner will need on top
(``KVBudget.reserved``: the peak of an eager prefill of ``max_num_batched_tokens`` with its
sampling rows, and with CUDA graphs the graph pool), measured on a scratch cache just large
enough, then freed. Under tensor parallel each rank measures on its own device (the
measurements run every rank's forward together: they are collectives), and the ranks compare
budgets before any raises, so a rank left without memory fails with the others, never alone
while they wait for it.
On CPU there is no device to fill: ``CPU_KV_CACHE_BYTES`` per rank, at most that share of the
host memory available. ``kv_cache_memory_bytes`` overrides both.
"""

from __future__ import annotations

import os

import torch

from samebits.config import CPU_KV_CACHE_BYTES, EngineConfig
from samebits.engine.cuda_graph import DecodeGraphs, batch_bucket
from samebits.engine.piecewise_graph import piecewise_tokens, token_buckets
from samebits.log import get_logger
from samebits.ops.backend import AttentionMetadata

# torch's caching allocator: blocks up to 1 MiB come from 2 MiB segments, larger ones from
# segments of at least 20 MiB; a graph's private pool rounds to these
_SMALL_SEGMENT, _LARGE_SEGMENT = 2 << 20, 20 << 20

log = get_logger("engine")


class KVBudget:
    def __init__(self, model: torch.nn.Module, config: EngineConfig, max_model_len: int) -> None:
        self.model, self.config, self.max_model_len = model, config, max_model_len
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.reserved = 0  # CUDA: activation + graph-pool bytes kept out of the KV budget

    def bytes(self) -> int:
        """This rank's bytes for the KV cache (module docstring); a ``ValueError`` naming
        ``gpu_memory_utilization`` when it leaves none."""
        util = self.config.gpu_memory_utilization
        if self.config.kv_cache_memory_bytes is not None:
            return self.config.kv_cache_memory_bytes
        if self.device.type != "cuda":
            return min(CPU_KV_CACHE_BYTES, int(util * available_host_memory()))
        self.reserved = self._activation_reserve()
        torch.cuda.empty_cache()  # the measurements' cached blocks: counted in reserved, not in use
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * util) - (total - free) - self.reserved
        group = getattr(self.model, "group", None)
        if group is not None and group.min_int(budget) <= 0 < budget:  # the ranks fail together
            raise ValueError(f"gpu_memory_utilization={util} leaves no memory for the KV cache "
                             "on another tensor-parallel rank (its error says why)")
        if budget <= 0:
            gib = 2 ** 30
            raise ValueError(
                f"gpu_memory_utilization={util} leaves no memory for the KV cache on "
                f"{self.device}: {util * total / gib:.1f} GiB allowed, {(total - free) / gib:.1f} "
                f"GiB in use (weights, other processes), {self.reserved / gib:.1f} GiB for "
                "activations and CUDA graphs; raise it or lower max_num_batched_tokens")
        log.info("KV cache budget on %s: %.2f GiB (%.2f GiB kept for activations and graphs)",
                 self.device, budget / 2 ** 30, self.reserved / 2 ** 30)
        return budget

    @torch.inference_mode()
    def _activation_reserve(self) -> int:
        """Peak bytes of an eager prefill of ``max_num_batched_tokens`` tokens with its sampling
        rows, plus, when decode steps run in CUDA graphs, the graph pool: the peak of a decode step
        of ``max_num_seqs`` sequences planned for the longest context (the temporaries every
        captured graph shares) and each graph's output; with piecewise graphs, their pool too (at
        most the eager prefill's peak: the same forward, at most as many rows), each chain's
        output and the q and attention buffers."""
        cfg, model, bs = self.config, self.model, self.config.block_size
        t = cfg.max_num_batched_tokens
        nb = -(-t // bs) + 1
        shape = model.kv_cache_shape(nb, bs)
        caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                   torch.zeros(shape, dtype=self.dtype, device=self.device))
                  for _ in range(len(model.layers))]
        prefill = self._peak(lambda: self._scratch_prefill(caches, t, nb))
        if cfg.enforce_eager:
            return prefill
        n = min(batch_bucket(cfg.max_num_seqs), t)
        decode = self._peak(lambda: self._scratch_decode(caches, n))
        outputs = DecodeGraphs.count(cfg.max_num_seqs, self.max_model_len, cfg.attention_split_size) \
            * cfg.max_num_seqs * model.cfg.hidden_size * self.dtype.itemsize
        return prefill + decode + outputs + self._piecewise_reserve(prefill)

    def _piecewise_reserve(self, pool_bound: int) -> int:
        """The piecewise graphs' bytes: their pool, at most ``pool_bound`` (the eager prefill's
        peak: the chains share one pool and stream, and the largest is a forward of at most
        ``max_num_batched_tokens`` rows), each chain's output and the q and attention buffers,
        and the caching allocator's rounding of a private pool: two large segments, a small
        one per chain; 0 where there are none."""
        model, tokens = self.model, piecewise_tokens(self.config, self.model)
        if tokens == 0:
            return 0
        attn, buckets = model.layers[0].self_attn, token_buckets(tokens)
        rows = sum(buckets) * model.cfg.hidden_size + 2 * tokens * attn.hq * attn.d
        rounding = 2 * _LARGE_SEGMENT + len(buckets) * _SMALL_SEGMENT
        return pool_bound + rows * self.dtype.itemsize + rounding

    def _peak(self, fn) -> int:
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - base

    def _scratch_prefill(self, caches: list, t: int, nb: int) -> None:
        dev, rows, ops = self.device, min(t, self.config.max_num_seqs), self.model.ops
        meta = AttentionMetadata(
            block_tables=torch.arange(nb - 1, dtype=torch.int32, device=dev)[None],
            seq_lens=torch.tensor([t], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=dev),
            slot_mapping=torch.arange(t, device=dev), seq_lens_list=(t,),
            query_start_loc_list=(0, t), block_size=self.config.block_size,
            split_size=self.config.attention_split_size)
        hidden = self.model(torch.zeros(t, dtype=torch.int64, device=dev),
                            torch.arange(t, device=dev) % self.max_model_len, caches,
                            ops.plan_attention(meta))
        ops.log_softmax(self.model.compute_logits(hidden[-rows:]))

    def _scratch_decode(self, caches: list, n: int) -> None:
        """One eager decode step of ``n`` sequences planned as the widest graph is."""
        dev, max_len, ops = self.device, self.max_model_len, self.model.ops
        width = -(-max_len // self.config.block_size)
        meta = AttentionMetadata(
            block_tables=torch.zeros(n, width, dtype=torch.int32, device=dev),
            seq_lens=torch.ones(n, dtype=torch.int32, device=dev),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
            slot_mapping=torch.arange(n, device=dev), seq_lens_list=(max_len,) * n,
            query_start_loc_list=tuple(range(n + 1)), block_size=self.config.block_size,
            split_size=self.config.attention_split_size)
        pos = torch.zeros(n, dtype=torch.int32, device=dev)
        meta = ops.plan_decode(meta, pos, max_len)
        hidden = self.model(torch.zeros(n, dtype=torch.int64, device=dev), pos.long(), caches, meta)
        ops.log_softmax(self.model.compute_logits(hidden))


def available_host_memory() -> int:
    """Bytes of host memory available now: Linux's MemAvailable (free plus reclaimable), else
    the free pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
