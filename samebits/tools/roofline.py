"""The physical limit of a generation workload on one GPU, from two measured ceilings.

A run of R requests, each a P-token prompt and G generated tokens, cannot finish faster than:

- prefill: its matrix FLOPs (2 x non-embedding weights x tokens, plus the causal attention's
  QK^T and PV products) at the measured bf16 MMA rate;
- decode: G steps over R sequences in batches of at most ``max_num_seqs``; each step reads every
  weight once (the embedding table only for its rows) and each sequence's KV cache, and does
  2 x weights FLOPs per token; a step takes at least max(bytes / bandwidth, flops / MMA rate).

Bandwidth is a large device-to-device copy (bytes read + written), the MMA rate an 8192^3 bf16
product, both measured in the run that reports the ratio.
"""

from __future__ import annotations

import dataclasses

import torch

from samebits.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Ceilings:
    bytes_per_s: float
    flops_per_s: float


def measure_ceilings(device: torch.device | str = "cuda", reps: int = 10) -> Ceilings:
    return Ceilings(copy_bandwidth(device, reps), mma_rate(device, reps))


def copy_bandwidth(device: torch.device | str = "cuda", reps: int = 10) -> float:
    """Bytes per second of a 1 GiB device-to-device copy, counting bytes read plus written."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / _median_seconds(lambda: dst.copy_(src), reps)


def mma_rate(device: torch.device | str = "cuda", reps: int = 10) -> float:
    """FLOP per second of an 8192^3 bf16 matrix product on random data."""
    a = torch.randn(8192, 8192, device=device).bfloat16()
    b = torch.randn(8192, 8192, device=device).bfloat16()
    return 2 * 8192 ** 3 / _median_seconds(lambda: a @ b, reps)


def _median_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times[3:])[reps // 2]


def limit_seconds(cfg: ModelConfig, itemsize: int, requests: int, prompt: int, generated: int,
                  max_num_seqs: int, ceil: Ceilings) -> float:
    """Lower bound on the wall time of the workload (module docstring)."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    weights = layers * per_layer + cfg.vocab_size * h  # the LM head; embedding rows are free
    attn = 2 * 2 * layers * q * prompt * prompt / 2  # QK^T and PV, causal half
    seconds = requests * (2 * weights * prompt + attn) / ceil.flops_per_s
    kv_per_token = 2 * layers * kv * itemsize
    for start in range(0, requests, max_num_seqs):
        batch = min(max_num_seqs, requests - start)
        for step in range(generated):
            nbytes = weights * itemsize + batch * (prompt + step) * kv_per_token
            flops = 2 * weights * batch + 4 * layers * q * batch * (prompt + step)
            seconds += max(nbytes / ceil.bytes_per_s, flops / ceil.flops_per_s)
    return seconds
