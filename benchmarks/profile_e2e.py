"""Where an end-to-end run spends its time, per mode: eager (prefill / mixed) steps against CUDA-graph
decode steps, and the top GPU kernels of the eager steps (torch.profiler). JSON lines.

    python benchmarks/profile_e2e.py --model benchmarks/configs/qwen3-8b.json --load-format dummy \
        --device cuda --num-prompts 64 --prompt-len 1024 --max-tokens 64
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from samebits import LLM, SamplingParams
from samebits.tools.bench import add_arguments, workload


def _timed_steps(llm: LLM, prompts: list, params: SamplingParams) -> dict:
    runner = llm.engine.runner
    run, sample = runner.run, runner._sample
    totals = {"graph": [0, 0.0], "eager": [0, 0.0], "sample": [0, 0.0]}

    def timed_sample(*args):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sample(*args)
        torch.cuda.synchronize()
        totals["sample"][0] += 1
        totals["sample"][1] += time.perf_counter() - t0

    def timed(batch):
        kind = "graph" if runner._graph_batch(batch) is not None else "eager"
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = run(batch)
        torch.cuda.synchronize()
        totals[kind][0] += 1
        totals[kind][1] += time.perf_counter() - t0
        return out

    runner.run, runner._sample = timed, timed_sample
    try:
        llm.generate(prompts, params)
    finally:
        runner.run, runner._sample = run, sample
    return {f"{k}_steps": v[0] for k, v in totals.items()} | \
        {f"{k}_seconds": round(v[1], 3) for k, v in totals.items()}


def _top_kernels(llm: LLM, prompts: list, max_tokens: int, n: int = 12) -> list:
    """Top GPU kernels (name, calls, ms) of a run with ``max_tokens`` new tokens per prompt."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:n]
    return [(e.key[:60], e.count, round(e.self_device_time_total / 1e3, 1)) for e in rows]


def _replay_ms(llm: LLM) -> dict:
    """GPU milliseconds of one replay of each captured decode step (its graphs; median of 20, events)."""
    graphs = llm.engine.runner.graphs
    out = {}
    for key, g in ({} if graphs is None else graphs.graphs).items():
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.launch()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        out[f"batch{key[0]}_len{key[1]}"] = round(sorted(times)[10], 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_arguments(p)
    args = p.parse_args()
    for invariant in (False, True):
        llm, prompts, params = workload(args, invariant)
        row = {"bench": "profile_e2e", "mode": "invariant" if invariant else "standard"}
        row |= _timed_steps(llm, prompts, params)
        row["graph_replay_ms"] = _replay_ms(llm)
        prefill = _top_kernels(llm, prompts, 1)
        row["prefill_top_kernels_ms"] = prefill
        row["decode_top_kernels_ms"] = _top_kernels(llm, prompts, 17, 16)
        print(json.dumps(row), flush=True)
        del llm
        gc.collect()  # the engine's KV cache must go before the next one sizes its own
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
