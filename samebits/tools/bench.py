"""End-to-end throughput: the invariant engine against the standard one, same run, JSON lines.

    samebits bench                                 # CPU: invariant, standard, transformers
    python benchmarks/e2e.py --model benchmarks/configs/qwen3-8b.json --load-format dummy \
        --device cuda --num-prompts 64 --prompt-len 1024 --max-tokens 256

Each line: mode, requests, prompt/generated tokens, seconds, generated tokens/s; the last line the
ratio invariant / standard (and a one-line summary on stderr). Progress bars go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from samebits import LLM, SamplingParams
from samebits.config import EngineConfig


def workload(args: argparse.Namespace, invariant: bool
             ) -> tuple[LLM, list[list[int]], SamplingParams]:
    """The engine for one mode, the random prompts and the sampling params, warmed up on the same
    shapes (kernels compiled, the decode graphs it will use captured)."""
    config = EngineConfig.from_cli_args(args, batch_invariant=invariant,
                                        enable_prefix_caching=False)
    llm = LLM(**dataclasses.asdict(config))
    rng = random.Random(0)
    vocab = llm.engine.loaded.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)]
               for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=7,
                            ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=min(4, args.max_tokens), ignore_eos=True))
    return llm, prompts, params


def run(args: argparse.Namespace, invariant: bool) -> dict:
    llm, prompts, params = workload(args, invariant)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=args.progress)
    seconds = time.perf_counter() - start
    generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"bench": "e2e", "mode": "invariant" if invariant else "standard",
            "device": _device_name(llm.config.torch_device), "requests": len(prompts),
            "cuda_graphs": _num_graphs(llm),
            "prompt_tokens": args.prompt_len * len(prompts), "generated_tokens": generated,
            "seconds": round(seconds, 3), "gen_tokens_per_s": round(generated / seconds, 2)}


def _limit(args: argparse.Namespace, results: dict) -> dict:
    """The workload's physical limit (samebits.tools.roofline) and each mode's share of it."""
    from samebits.config import ModelConfig
    from samebits.tools.roofline import limit_seconds, measure_ceilings

    path = Path(args.model or "")
    path = path / "config.json" if path.is_dir() else path
    if path.suffix != ".json":
        return {}
    cfg, ceil = ModelConfig.from_file(path), measure_ceilings()
    seconds = limit_seconds(cfg, 2, args.num_prompts, args.prompt_len, args.max_tokens,
                            args.max_num_seqs, ceil)
    limit = args.num_prompts * args.max_tokens / seconds
    return {"copy_GB_s": round(ceil.bytes_per_s / 1e9, 1),
            "mma_TFLOP_s": round(ceil.flops_per_s / 1e12, 1),
            "physical_limit_tok_s": round(limit, 1)} | {
        f"{mode}_over_limit": round(r["gen_tokens_per_s"] / limit, 3)
        for mode, r in results.items()}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _num_graphs(llm: LLM) -> int:
    graphs = llm.engine.runner.graphs
    return 0 if graphs is None else len(graphs.graphs)


def add_arguments(p: argparse.ArgumentParser) -> None:
    EngineConfig.add_cli_args(p)
    p.add_argument("--num-prompts", type=int, default=16, help="requests per mode")
    p.add_argument("--prompt-len", type=int, default=128, help="random prompt tokens each")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bars on stderr (bars shown: %(default)s)")


    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16],
                   help="CPU: batch sizes of the side-by-side run")
    p.add_argument("--repeats", type=int, default=3, help="CPU: interleaved runs per engine")
    p.add_argument("--threads", type=int, default=2, help="CPU: torch threads")


def run_both(args: argparse.Namespace) -> None:
    """On CPU the side-by-side run (samebits.tools.bench_cpu); else standard, then invariant (JSON
    line each), then the ratio line and a summary on stderr."""
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        from samebits.tools import bench_cpu
        bench_cpu.side_by_side(args)
        return
    results = {}
    for invariant in tqdm((False, True), desc="modes", unit="mode", disable=not args.progress):
        r = run(args, invariant)
        gc.collect()  # the first engine's KV cache must be gone before the second sizes its own
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        results[r["mode"]] = r
        print(json.dumps(r), flush=True)
    ratio = results["invariant"]["gen_tokens_per_s"] / results["standard"]["gen_tokens_per_s"]
    print(json.dumps({"bench": "e2e", "enforce_eager": args.enforce_eager,
                      "ratio_invariant_over_standard": round(ratio, 3)} | _limit(args, results)))
    inv, std = results["invariant"], results["standard"]
    print(f"invariant {inv['gen_tokens_per_s']} tok/s, standard {std['gen_tokens_per_s']} tok/s "
          f"({ratio:.3f}x) on {inv['device']}, {inv['requests']} requests", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_arguments(p)
    run_both(p.parse_args(argv))


if __name__ == "__main__":
    main()
