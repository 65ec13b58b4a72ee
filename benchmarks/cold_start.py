"""The first request after start against the same request warm, JSON lines.

    python benchmarks/cold_start.py --model benchmarks/configs/qwen3-8b.json --load-format dummy

Prints the engine's start time (weights + KV cache + CUDA-graph captures), the decode graphs
captured and the capture seconds, then tok/s of the first request of each prompt length (each
meets a context no earlier request met) and of the same request again, and their ratio (target
>= 0.95: no capture, compile or allocation stalls a request after start).
"""

from __future__ import annotations

import argparse
import json
import time

from samebits import LLM, SamplingParams


def log_compiles() -> None:
    """Print a JSON line for every Triton kernel compiled from now on (what stalls a request)."""
    from triton.runtime.jit import JITFunction

    inner = JITFunction._do_compile

    def timed(self, *args, **kwargs):  # (key, signature, device, constexprs, options, attrs, ...)
        t = time.perf_counter()
        out = inner(self, *args, **kwargs)
        named = dict(zip(("key", "signature", "device", "constexprs", "options", "attrs"), args,
                         strict=False))
        print(json.dumps({"compile": self.fn.__name__, "seconds": round(time.perf_counter() - t, 3)}
                         | {k: str(named.get(k))[:300] for k in ("signature", "constexprs", "attrs")}),
              flush=True)
        return out

    JITFunction._do_compile = timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 3000])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--log-compiles", action="store_true",
                   help="print each Triton compile after start (kernel, seconds)")
    args = p.parse_args()
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format=args.load_format, device=args.device,
              enable_prefix_caching=False)
    graphs = llm.engine.runner.graphs
    print(json.dumps({"bench": "cold_start", "start_seconds": round(time.perf_counter() - t0, 2),
                      "graphs": 0 if graphs is None else len(graphs.graphs),
                      "capture_seconds": None if graphs is None else round(graphs.capture_seconds, 2)}),
          flush=True)
    if args.log_compiles:
        log_compiles()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for n in args.prompt_lens:
        prompt = [100 + (i * 7) % 5000 for i in range(n)]
        rates = []
        for _ in range(2):  # cold, then warm
            t = time.perf_counter()
            out = llm.generate([prompt], params)[0].outputs[0]
            rates.append(len(out.token_ids) / (time.perf_counter() - t))
        print(json.dumps({"bench": "cold_start", "prompt_len": n, "cold_tok_s": round(rates[0], 1),
                          "warm_tok_s": round(rates[1], 1),
                          "ratio_cold_over_warm": round(rates[0] / rates[1], 3)}), flush=True)


if __name__ == "__main__":
    main()
