"""Where a tensor-parallel step spends its time on rank 0 (torch.profiler over the CUDA graphs'
kernels): JSON lines per workload -- wall seconds, the GPU's busy share of the wall, the
communication share of the GPU's time (NCCL kernels), and the top kernels.

    python benchmarks/tp_profile.py --model benchmarks/configs/qwen3-8b.json --tp 2
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

WORKLOADS = {"decode-bs1": (1, 128, 64), "decode-bs64": (64, 128, 32), "prefill": (16, 1024, 1)}


def _summary(prof, wall: float, top: int) -> dict:
    rows = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in rows) / 1e6
    comm = sum(e.self_device_time_total for e in rows if "nccl" in e.key.lower()) / 1e6
    rows.sort(key=lambda e: -e.self_device_time_total)
    return {"wall_s": round(wall, 4), "gpu_s": round(total, 4),
            "gpu_busy_share": round(total / wall, 3),
            "comm_share_of_gpu": round(comm / total, 3) if total else None,
            "top": [(e.key[:70], e.count, round(e.self_device_time_total / 1e3, 2))
                    for e in rows[:top]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="benchmarks/configs/qwen3-8b.json")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    from samebits import LLM, SamplingParams
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", tensor_parallel_size=args.tp,
              max_num_seqs=64, max_model_len=2048, enable_prefix_caching=False)
    vocab = llm.engine.loaded.model_config.vocab_size
    for name, (n, prompt, gen) in WORKLOADS.items():
        prompts = [[(7 * i + j) % (vocab - 1) + 1 for j in range(prompt)] for i in range(n)]
        params = SamplingParams(max_tokens=gen, ignore_eos=True, temperature=0.0)
        llm.generate(prompts, params)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            llm.generate(prompts, params)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        print(json.dumps({"tp": args.tp, "workload": name, "requests": n, "prompt": prompt,
                          "generated": gen} | _summary(prof, wall, args.top)), flush=True)
    llm.engine.runner.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
