"""Batch-1 greedy decode against the HBM roofline, with a per-step kernel profile. JSON lines.

    python benchmarks/decode_roofline.py --model benchmarks/configs/qwen3-8b.json
    python benchmarks/decode_roofline.py --batch 64 --prompt-len 1024 --max-tokens 65

Roofline: a decode step must read every weight once (the embedding table only for its one row
unless it is also the LM head), so tok/s <= copy bandwidth / weight bytes, with the bandwidth
measured here (a large device-to-device copy, bytes read + written). Decode tok/s is
``(N - 1) / (t(N) - t(1))`` for N new tokens, so the prefill cancels. The profile is the difference
of two profiled runs (17 and 1 new tokens) divided by 16: each kernel's launches and GPU
microseconds per decode step, and the step's kernel count (with programmatic dependent launch
a kernel's time includes its wait for the previous one: compare ``graph_replay_us``, one replay
of the step's graph, and ``host_gap_us``, the host's time between a step's read and the next
replay, with the wall time per step). ``--batch`` > 1: the roofline counts the weights only.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from samebits import LLM, SamplingParams
from samebits.tools.roofline import copy_bandwidth


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads from the weights: all of them but an untied embedding table."""
    total = 0
    for name, p in model.named_parameters():
        if name == "embed_tokens.weight" and not model.lm_head.tied:
            total += p.shape[1] * p.element_size()
            continue
        total += p.numel() * p.element_size()
    return total


def generate(llm: LLM, prompts: list[list[int]], tokens: int, temperature: float) -> None:
    llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True,
                                         temperature=temperature, seed=0))


def decode_rate(llm: LLM, prompts: list[list[int]], n: int, temperature: float) -> float:
    """Decode tokens per second over the batch."""
    def timed(tokens: int) -> float:
        t0 = time.perf_counter()
        generate(llm, prompts, tokens, temperature)
        return time.perf_counter() - t0

    timed(n)  # warm
    best_n, best_1 = min(timed(n) for _ in range(2)), min(timed(1) for _ in range(3))
    return len(prompts) * (n - 1) / (best_n - best_1)


def _gpu_idle(events) -> dict[str, float]:
    """GPU idle microseconds between consecutive kernels/copies, by (previous, next) name pair."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name[:40]) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    idle: dict[str, float] = collections.defaultdict(float)
    end, prev = spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > end:
            idle[f"{prev} -> {name}"] += start - end
        if stop > end:
            end, prev = stop, name
    return idle


def kernel_profile(llm: LLM, prompts: list[list[int]], temperature: float, steps: int = 16
                   ) -> tuple[list[tuple[str, float, float]], list[tuple[str, float]]]:
    """(kernel, launches per decode step, GPU us per decode step), largest first; and the GPU's
    idle us per decode step between kernels, by (previous -> next) kernel, largest first."""
    def run(tokens: int) -> tuple[dict[str, list[float]], dict[str, float]]:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            generate(llm, prompts, tokens, temperature)
            torch.cuda.synchronize()
        agg: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                agg[e.name][0] += 1
                agg[e.name][1] += e.device_time
        return agg, _gpu_idle(prof.events())

    (long, long_idle), (short, short_idle) = run(steps + 1), run(1)
    rows = [(name[:70], (c - short.get(name, [0, 0])[0]) / steps,
             (t - short.get(name, [0, 0.0])[1]) / steps) for name, (c, t) in long.items()]
    idle = [(k, (v - short_idle.get(k, 0.0)) / steps) for k, v in long_idle.items()]
    return (sorted((r for r in rows if r[1] > 0), key=lambda r: -r[2]),
            sorted((r for r in idle if r[1] > 0.5), key=lambda r: -r[1]))


def graph_us(llm: LLM, batch: int, context: int, reps: int = 50) -> dict[str, float]:
    """Microseconds of the decode graph for ``batch`` sequences of ``context`` tokens: per replay
    with replays back to back (the step's forward without the host's work between steps), one
    replay from an idle device to its end (the launch latency included), and the host's time in
    the ``replay()`` call."""
    from samebits.engine.cuda_graph import batch_bucket, len_bucket
    graphs = llm.engine.runner.graphs
    g = graphs.graphs[(batch_bucket(batch), len_bucket(context, graphs.split_size))]
    g.launch()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        g.launch()
    torch.cuda.synchronize()
    back_to_back = (time.perf_counter() - t0) / reps
    single, host = [], []
    for _ in range(reps // 5):
        t0 = time.perf_counter()
        g.launch()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        single.append(time.perf_counter() - t0)
        host.append(t1 - t0)
    return {"graph_replay_us": round(back_to_back * 1e6, 1),
            "graph_single_replay_us": round(sorted(single)[len(single) // 2] * 1e6, 1),
            "graph_launch_host_us": round(sorted(host)[len(host) // 2] * 1e6, 1)}


def host_gap_us(llm: LLM, prompts: list[list[int]], temperature: float, tokens: int = 65
                ) -> float:
    """Median microseconds from the host's read of a decode step's tokens to the next graph
    replay: host work (bookkeeping, scheduling, input copies), while the device idles -- unless
    a step launched ahead (async scheduling) keeps it busy."""
    from samebits.engine import cuda_graph, runner
    marks: list[tuple[str, float]] = []
    replay, sample = cuda_graph._Captured.replay, runner.ModelRunner._sample

    def timed_replay(self, *args):
        marks.append(("replay", time.perf_counter()))
        return replay(self, *args)

    def timed_sample(self, *args):
        sample(self, *args)
        marks.append(("read", time.perf_counter()))

    cuda_graph._Captured.replay, runner.ModelRunner._sample = timed_replay, timed_sample
    try:
        generate(llm, prompts, tokens, temperature)
    finally:
        cuda_graph._Captured.replay, runner.ModelRunner._sample = replay, sample
    gaps = sorted(b[1] - a[1] for a, b in zip(marks, marks[1:], strict=False)
                  if a[0] == "read" and b[0] == "replay")
    return gaps[len(gaps) // 2] * 1e6


def linear_prefetch_kb() -> int:
    from samebits.ops.triton import linear_tiles
    return linear_tiles.PREFETCH // 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="benchmarks/configs/qwen3-8b.json")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--max-tokens", type=int, default=257)
    p.add_argument("--standard", action="store_true", help="the standard mode (stock ops)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: max(8, batch)")
    p.add_argument("--top", type=int, default=25, help="kernels listed")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="wait for each step's tokens before launching the next (A/B)")
    p.add_argument("--no-pdl", action="store_true",
                   help="launch without programmatic dependent launch (A/B)")
    p.add_argument("--prefetch-kb", type=int, default=None,
                   help="weight KiB a GEMV program prefetches before its input is ready "
                        "(default: samebits.ops.triton.linear_tiles.PREFETCH)")
    args = p.parse_args()
    if args.prefetch_kb is not None:  # before the first tile is picked (pick_config caches)
        from samebits.ops.triton import linear_tiles
        linear_tiles.PREFETCH = args.prefetch_kb * 1024
    if args.no_pdl:
        from samebits.ops.triton import launcher
        launcher._programmatic_device = lambda index: False
    bw = copy_bandwidth()
    llm = LLM(args.model, load_format=args.load_format, device="cuda", enable_prefix_caching=False,
              batch_invariant=not args.standard, async_scheduling=not args.no_async_scheduling,
              max_num_seqs=args.max_num_seqs or max(8, args.batch))
    nbytes = weight_bytes(llm.engine.loaded.model)
    prompts = [[100 + (i + 7 * b) % 5000 for i in range(args.prompt_len)]
               for b in range(args.batch)]
    rate = decode_rate(llm, prompts, args.max_tokens, args.temperature)
    roof = args.batch * bw / nbytes  # batch > 1: weights only, the KV reads left out
    print(json.dumps({"bench": "decode_roofline", "device": torch.cuda.get_device_name(),
                      "mode": "standard" if args.standard else "invariant",
                      "pdl": not args.no_pdl, "prefetch_kb": linear_prefetch_kb(),
                      "async_scheduling": not args.no_async_scheduling,
                      "steps_served_ahead": llm.engine.runner.ahead_steps_used,
                      "copy_GB_s": round(bw / 1e9, 1), "weight_GB": round(nbytes / 1e9, 3),
                      "roofline_tok_s": round(roof, 1), "decode_tok_s": round(rate, 1),
                      "ratio_to_roofline": round(rate / roof, 3)}), flush=True)
    rows, idle = kernel_profile(llm, prompts, args.temperature)
    context = args.prompt_len + args.max_tokens // 2
    print(json.dumps({"bench": "decode_profile", "kernels_per_step": round(sum(r[1] for r in rows)),
                      "gpu_us_per_step": round(sum(r[2] for r in rows), 1)}
                     | graph_us(llm, args.batch, context) | {
                      "host_gap_us": round(host_gap_us(llm, prompts, args.temperature), 1),
                      "gpu_idle_us_per_step": round(sum(t for _, t in idle), 1),
                      "wall_us_per_step": round(1e6 * args.batch / rate, 1)}), flush=True)
    for name, count, t in rows[:args.top]:
        print(json.dumps({"kernel": name, "per_step": round(count, 2), "us": round(t, 1)}))
    for pair, t in idle[:args.top]:
        print(json.dumps({"gpu_idle": pair, "us_per_step": round(t, 1)}))


if __name__ == "__main__":
    main()
