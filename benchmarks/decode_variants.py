"""A/B of kernel-policy settings on batch-1 decode, in one process. JSON lines.

    python benchmarks/decode_variants.py --model benchmarks/configs/qwen3-30b-a3b.json \
        --variant "partials off" "samebits.ops.triton.backend:TritonBackend.partials_into_norm_rows=0" \
        --rounds 2

Loads the model once (the 61 GB MoE shapes take ~65 s), then for each round and each variant --
the default first -- sets the variant's attributes, drops the tile policies' caches, recaptures
the CUDA graphs through ``sleep(1)`` / ``wake_up()`` (a few seconds) and measures: decode
tok/s (``decode_rate``: the prefill cancels), the graph replay time of one batch-1 step
(``graph_us``), the ratio of each to the default's in the same round, and a hash of 64 greedy
tokens (a setting that only moves speed leaves it unchanged). The settings are restored after each variant.

A setting is ``module:attr.path=expression``; the expression is evaluated in the module's
namespace (``GemmConfig(16, 64, 256, 4, 4, tma=True)`` works in ``linear_tiles``). A variant
holds one or more settings, separated by ``;``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from decode_roofline import decode_rate, graph_us  # noqa: E402

from samebits import LLM, SamplingParams  # noqa: E402

CACHED = ("samebits.ops.triton.linear", "samebits.ops.triton.linear_tiles",
          "samebits.ops.triton.moe", "samebits.ops.triton.rms_norm")


def parse(setting: str) -> tuple[dict, object, str, str]:
    """``module:a.b.c=expr`` -> (the module's namespace, the object holding ``c``, "c", "expr")."""
    target, _, expr = setting.partition("=")
    module, _, path = target.partition(":")
    if not expr or not path:
        raise SystemExit(f"--variant: {setting!r} is not module:attr=expression")
    holder = module = importlib.import_module(module.strip())
    *parents, leaf = path.strip().split(".")
    for name in parents:
        holder = getattr(holder, name)
    if not hasattr(holder, leaf):
        raise SystemExit(f"--variant: {target!r} names no attribute")
    return vars(module), holder, leaf, expr.strip()


def apply(settings: list[str]) -> list[tuple[object, str, object]]:
    """Set each setting; returns what to restore."""
    undo = []
    for setting in settings:
        namespace, holder, leaf, expr = parse(setting)
        undo.append((holder, leaf, getattr(holder, leaf)))
        setattr(holder, leaf, eval(expr, namespace))  # noqa: S307 (a benchmark's own CLI)
    return undo


def drop_caches() -> None:
    """Clear every lru_cache of the tile-policy modules: a plan picked before must not stay."""
    for name in CACHED:
        for value in vars(importlib.import_module(name)).values():
            if isinstance(value, functools._lru_cache_wrapper):
                value.cache_clear()


def measure(llm: LLM, prompts: list[list[int]], tokens: int) -> dict:
    drop_caches()
    llm.sleep(1)  # the KV cache and the graphs over it go; wake_up captures them anew
    llm.wake_up()
    rate = decode_rate(llm, prompts, tokens, 0.0)
    step = graph_us(llm, 1, len(prompts[0]) + tokens)["graph_replay_us"]
    ids = llm.generate(prompts, SamplingParams(max_tokens=64, ignore_eos=True,
                                               temperature=0.0))[0].outputs[0].token_ids
    return {"decode_tok_s": round(rate, 1), "step_us": step,
            "tokens_hash": f"{hash(tuple(ids)) & 0xFFFFFFFF:08x}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="benchmarks/configs/qwen3-30b-a3b.json")
    p.add_argument("--variant", nargs=2, action="append", default=[], metavar=("NAME", "SETS"),
                   help="a name and its settings (module:attr=expression; ...)")
    p.add_argument("--rounds", type=int, default=2, help="every variant once a round")
    p.add_argument("--max-tokens", type=int, default=129)
    args = p.parse_args()
    variants = [(name, [s for s in sets.split(";") if s.strip()]) for name, sets in args.variant]
    for _, sets in variants:
        for setting in sets:
            parse(setting)  # refuse a bad setting before the model loads
    t0 = time.time()
    llm = LLM(args.model, load_format="dummy", device="cuda", enable_prefix_caching=False,
              max_num_seqs=8, max_model_len=1024, enable_sleep_mode=True)
    print(json.dumps({"bench": "decode_variants", "model": args.model,
                      "load_s": round(time.time() - t0, 1)}), flush=True)
    prompts = [[100 + i % 5000 for i in range(128)]]
    for r in range(args.rounds):
        base = measure(llm, prompts, args.max_tokens)
        print(json.dumps({"round": r, "variant": "default", **base}), flush=True)
        for name, sets in variants:
            undo = apply(sets)
            try:
                got = measure(llm, prompts, args.max_tokens)
            finally:
                for holder, leaf, old in reversed(undo):
                    setattr(holder, leaf, old)
            print(json.dumps({
                "round": r, "variant": name, **got,
                "tok_s_ratio_to_default": round(got["decode_tok_s"] / base["decode_tok_s"], 4),
                "step_ratio_to_default": round(got["step_us"] / base["step_us"], 4),
                "same_tokens": got["tokens_hash"] == base["tokens_hash"]}), flush=True)


if __name__ == "__main__":
    main()
