"""Sampling cost per step and its share of decode, JSON lines.

    python benchmarks/sampler.py --device cuda --vocab 151936          # sampler alone
    python benchmarks/sampler.py --device cuda --reference             # and the sorted path
    python benchmarks/sampler.py --device cuda --e2e benchmarks/configs/qwen3-8b.json

``sampler`` lines: ms per ``sample`` call (logits [B, V] fp32 in, token ids out, host sync
included) for greedy, top-p, top-k, min-p and all three, with the ratio to greedy; with
``--reference`` also ``sampler_sorted`` lines, the same calls through ``sample_sorted`` (one
stable sort per filtered row) timed in the same run, and the speedup of ``sample``. ``e2e``
lines: batch-1 decode tok/s of a dummy-weight model, top-p and top-k against greedy (target >= 0.97).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from samebits import LLM, SamplingParams
from samebits.engine import sampler

KINDS = {
    "greedy": SamplingParams(temperature=0.0),
    "top_p": SamplingParams(temperature=0.8, top_p=0.95),
    "top_k": SamplingParams(temperature=0.8, top_k=50),
    "min_p": SamplingParams(temperature=0.8, min_p=0.05),
    "combined": SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_sampler(device: torch.device, vocab: int, batch: int, kind: str, iters: int,
                 fn=sampler.sample) -> float:
    """Median ms of one ``fn`` (sample() or sample_sorted()) call on realistic (peaked) logits."""

    gen = torch.Generator(device=device).manual_seed(batch)
    logits = torch.randn(batch, vocab, device=device, generator=gen) * 4
    params = [KINDS[kind]] * batch
    times = []
    for i in range(iters + 3):
        _sync(device)
        t0 = time.perf_counter()
        fn(logits, params, list(range(batch)), [i] * batch)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times[3:])[iters // 2] * 1e3


def bench_sampler(args: argparse.Namespace, device: torch.device) -> None:
    for batch in args.batches:
        ms = {k: time_sampler(device, args.vocab, batch, k, args.iters) for k in KINDS}
        for kind, t in ms.items():
            print(json.dumps({"bench": "sampler", "device": str(device), "vocab": args.vocab,
                              "batch": batch, "kind": kind, "ms": round(t, 3),
                              "ratio_to_greedy": round(t / ms["greedy"], 2)}), flush=True)
        if args.reference:
            for kind in KINDS:
                ref = time_sampler(device, args.vocab, batch, kind, args.iters, sampler.sample_sorted)
                print(json.dumps({"bench": "sampler_sorted", "device": str(device),
                                  "vocab": args.vocab, "batch": batch, "kind": kind,
                                  "ms": round(ref, 3), "speedup_of_sample": round(ref / ms[kind], 2)}),
                      flush=True)


def bench_e2e(args: argparse.Namespace) -> None:
    llm = LLM(args.e2e, load_format="dummy", device=args.device, enable_prefix_caching=False)
    prompt = list(range(100, 100 + args.prompt_len))
    rates = {}
    for kind in ("greedy", "top_p", "top_k") * 2:  # the second round is reported
        p = KINDS[kind]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=p.temperature,
                                top_p=p.top_p, top_k=p.top_k, seed=3, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate([prompt], params)[0].outputs[0]
        rates[kind] = len(out.token_ids) / (time.perf_counter() - t0)
    print(json.dumps({"bench": "e2e_bs1", "model": args.e2e} | {
        f"{k}_tok_s": round(r, 1) for k, r in rates.items()} | {
        f"ratio_{k}_over_greedy": round(r / rates["greedy"], 3) for k, r in rates.items()}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--reference", action="store_true",
                   help="also time sample_sorted (the full-sort path) in the same run")
    p.add_argument("--e2e", default=None, help="config.json of a model for the bs=1 decode check")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args()
    bench_sampler(args, torch.device(args.device))
    if args.e2e:
        bench_e2e(args)


if __name__ == "__main__":
    main()
