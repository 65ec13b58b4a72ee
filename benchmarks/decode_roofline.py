"""Batch-1 greedy decode against the HBM roofline, with a per-step kernel profile. JSON lines.

    python benchmarks/decode_roofline.py --model benchmarks/configs/qwen3-8b.json

Roofline: a decode step must read every weight once (the embedding table only for its one row
unless it is also the LM head), so tok/s <= copy bandwidth / weight bytes, with the bandwidth
measured here (a large device-to-device copy, bytes read + written). Decode tok/s is
``(N - 1) / (t(N) - t(1))`` for N new tokens, so the prefill cancels. The profile is the difference
of two profiled runs (17 and 1 new tokens) divided by 16: each kernel's launches and GPU
microseconds per decode step, and the step's kernel count.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from samebits import LLM, SamplingParams
from samebits.roofline import copy_bandwidth


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads from the weights: all of them but an untied embedding table."""
    total = 0
    for name, p in model.named_parameters():
        if name == "embed_tokens" and getattr(model, "lm_head", None) is not None:
            total += p.shape[1] * p.element_size()
            continue
        total += p.numel() * p.element_size()
    return total


def decode_rate(llm: LLM, prompt: list[int], n: int) -> float:
    def timed(tokens: int) -> float:
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - t0

    timed(n)  # warm
    return (n - 1) / (min(timed(n) for _ in range(2)) - min(timed(1) for _ in range(3)))


def kernel_profile(llm: LLM, prompt: list[int], steps: int = 16) -> list[tuple[str, float, float]]:
    """(kernel, launches per decode step, GPU us per decode step), largest first."""
    def run(tokens: int) -> dict[str, list[float]]:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True))
            torch.cuda.synchronize()
        agg: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                agg[e.name][0] += 1
                agg[e.name][1] += e.device_time
        return agg

    long, short = run(steps + 1), run(1)
    rows = [(name[:70], (c - short.get(name, [0, 0])[0]) / steps,
             (t - short.get(name, [0, 0.0])[1]) / steps) for name, (c, t) in long.items()]
    return sorted((r for r in rows if r[1] > 0), key=lambda r: -r[2])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="benchmarks/configs/qwen3-8b.json")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=257)
    p.add_argument("--standard", action="store_true", help="the standard mode (stock ops)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--top", type=int, default=25, help="kernels listed")
    args = p.parse_args()
    bw = copy_bandwidth()
    llm = LLM(args.model, load_format=args.load_format, device="cuda", enable_prefix_caching=False,
              batch_invariant=not args.standard, max_num_seqs=args.max_num_seqs)
    nbytes = weight_bytes(llm.engine.loaded.model)
    prompt = [100 + i % 5000 for i in range(args.prompt_len)]
    rate = decode_rate(llm, prompt, args.max_tokens)
    roof = bw / nbytes
    print(json.dumps({"bench": "decode_roofline", "device": torch.cuda.get_device_name(),
                      "mode": "standard" if args.standard else "invariant",
                      "copy_GB_s": round(bw / 1e9, 1), "weight_GB": round(nbytes / 1e9, 3),
                      "roofline_tok_s": round(roof, 1), "decode_tok_s": round(rate, 1),
                      "ratio_to_roofline": round(rate / roof, 3)}), flush=True)
    rows = kernel_profile(llm, prompt)
    print(json.dumps({"bench": "decode_profile", "kernels_per_step": round(sum(r[1] for r in rows)),
                      "gpu_us_per_step": round(sum(r[2] for r in rows), 1),
                      "wall_us_per_step": round(1e6 / rate, 1)}), flush=True)
    for name, count, t in rows[:args.top]:
        print(json.dumps({"kernel": name, "per_step": round(count, 2), "us": round(t, 1)}))


if __name__ == "__main__":
    main()
