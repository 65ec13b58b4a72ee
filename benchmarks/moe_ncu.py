"""A target for Nsight Compute: one decode token through the MoE experts (Qwen3-30B-A3B shapes, bf16
random weights) and one dense GEMV of the same model (qkv: K 2048, N 5120), after three warm-ups.

    ncu -k regex:"_moe_gemm_kernel|_linear_kernel" -s 9 -c 3 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \\
        --section LaunchStats --section SchedulerStats python benchmarks/moe_ncu.py

(``-s 9`` skips the warm-ups' nine launches: gate/up, down and the GEMV, three times.)
"""

from __future__ import annotations

import torch

from samebits.ops.triton import linear as L
from samebits.ops.triton import moe as M

EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8


def main() -> None:
    torch.manual_seed(0)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda") / 45).bfloat16()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda") / 28).bfloat16()
    x = torch.randn(1, HIDDEN, device="cuda").bfloat16()
    weights, ids = M.route(torch.randn(1, EXPERTS, device="cuda").bfloat16(), TOP_K, True, True)
    w_qkv = (torch.randn(5120, HIDDEN, device="cuda") / 45).bfloat16()
    for _ in range(4):  # three warm-ups, then the profiled launches
        M.fused_experts(x, w13, w2, weights, None, None, ids=ids)
        L.linear(x, w_qkv)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
