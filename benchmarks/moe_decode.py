"""Mixture-of-experts speed on one GPU: Qwen3-30B-A3B shapes in bf16, dummy weights. JSON lines.

    python benchmarks/moe_decode.py --part decode   # batch-1 greedy decode vs one token's bytes
    python benchmarks/moe_decode.py --part e2e      # 16 x 1k/1k, invariant vs standard
    python benchmarks/moe_decode.py --part layer    # one MoE layer's experts by batch size

decode: greedy decode tok/s at batch 1 (``(N - 1) / (t(N) - t(1))``, the prefill cancels) and its
share of the roofline ``copy bandwidth / bytes one token reads``: every weight once except the
experts, of which only the top-k routed ones (8 of 128 per layer) count, and one embedding row;
the bandwidth is a 1 GiB device copy measured in the same run. Then the kernels of a decode step
(``decode_roofline.kernel_profile``).

e2e: 16 requests of 1024 random prompt tokens and 1024 generated (temperature 0.8), all in one
batch, each mode in a fresh engine (the model is 61 GB: one at a time). The standard mode is
stock PyTorch: cuBLAS linears, torch.softmax / torch.topk routing, the experts through
``torch.nn.functional.grouped_mm`` over expert-sorted tokens (transformers' default experts
path), SDPA prefill and flash-decoding attention.

layer: one layer's experts (routing given) on T tokens, each path replayed from a CUDA graph:
the invariant Triton kernels against ``grouped_mm``, and the invariant kernels' bytes/s (the
routed experts' weights, read once) against the copy bandwidth.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_roofline import decode_rate, kernel_profile  # noqa: E402

from samebits import LLM, SamplingParams  # noqa: E402
from samebits.tools.roofline import copy_bandwidth  # noqa: E402

CONFIG = str(Path(__file__).parent / "configs" / "qwen3-30b-a3b.json")


def token_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode token reads: each weight once, the routed experts only, one embedding
    row (the LM head is read whole)."""
    cfg, total = model.cfg, 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if name.endswith(("experts_gate_up", "experts_down")):
            nbytes = nbytes * cfg.moe.top_k // cfg.moe.num_experts
        elif name == "embed_tokens.weight" and not model.lm_head.tied:
            nbytes = p.shape[1] * p.element_size()
        total += nbytes
    return total


def _device() -> str:
    return torch.cuda.get_device_name()


def decode(args: argparse.Namespace, bandwidth: float) -> None:
    llm = LLM(args.model, load_format="dummy", device="cuda", enable_prefix_caching=False,
              max_num_seqs=8, max_model_len=1024)
    nbytes = token_bytes(llm.engine.loaded.model)
    prompts = [[100 + i % 5000 for i in range(128)]]
    rate = decode_rate(llm, prompts, args.max_tokens, 0.0)
    roof = bandwidth / nbytes
    print(json.dumps({"bench": "moe_decode", "device": _device(), "mode": "invariant",
                      "pdl": not args.no_pdl, "batch": 1, "copy_GB_s": round(bandwidth / 1e9, 1),
                      "token_GB": round(nbytes / 1e9, 3), "roofline_tok_s": round(roof, 1),
                      "decode_tok_s": round(rate, 1), "ratio_to_roofline": round(rate / roof, 3),
                      "target_ratio": 0.6}), flush=True)
    if args.no_profile:
        return
    rows, idle = kernel_profile(llm, prompts, 0.0)
    print(json.dumps({"bench": "moe_decode_profile",
                      "kernels_per_step": round(sum(r[1] for r in rows)),
                      "gpu_us_per_step": round(sum(r[2] for r in rows), 1),
                      "top": [[n, round(c, 2), round(us, 1)] for n, c, us in rows[:args.top]],
                      "idle_us": [[k, round(v, 1)] for k, v in idle[:10]]}), flush=True)


def e2e(args: argparse.Namespace) -> None:
    results = {}
    for invariant in (False, True):
        llm = LLM(args.model, load_format="dummy", device="cuda", enable_prefix_caching=False,
                  batch_invariant=invariant, max_num_seqs=args.num_prompts,
                  max_model_len=args.prompt_len + args.gen_len + 16,
                  enforce_eager=args.enforce_eager)
        vocab = llm.engine.loaded.model_config.vocab_size
        prompts = [[(7919 * (i + 1) * (j + 3)) % vocab for j in range(args.prompt_len)]
                   for i in range(args.num_prompts)]
        params = SamplingParams(max_tokens=args.gen_len, temperature=0.8, top_p=0.95, seed=7,
                                ignore_eos=True)
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        mode = "invariant" if invariant else "standard"
        results[mode] = generated / seconds
        print(json.dumps({"bench": "moe_e2e", "device": _device(), "mode": mode,
                          "cuda_graphs": not args.enforce_eager, "requests": args.num_prompts,
                          "prompt_len": args.prompt_len, "gen_len": args.gen_len,
                          "seconds": round(seconds, 2),
                          "gen_tokens_per_s": round(generated / seconds, 1)}), flush=True)
        del llm, outs
        gc.collect()
        torch.cuda.empty_cache()
    print(json.dumps({"bench": "moe_e2e", "ratio_invariant_over_standard":
                      round(results["invariant"] / results["standard"], 3),
                      "standard_experts": "torch.nn.functional.grouped_mm", "target_ratio": 1.0}),
          flush=True)


def _graph_us(fn, reps: int = 50) -> float:
    """Microseconds per replay of ``fn`` captured in a CUDA graph (replays back to back)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e6


def layer(args: argparse.Namespace, bandwidth: float) -> None:
    from samebits.config import read_json
    from samebits.models import registry
    from samebits.ops import moe as ops_moe
    from samebits.ops.triton import moe as triton_moe
    model_cfg = registry.model_config(read_json(Path(args.model)))
    moe, h = model_cfg.moe, model_cfg.hidden_size
    e, i, k = moe.num_experts, moe.moe_intermediate_size, moe.top_k
    w13 = (torch.randn(e, 2 * i, h, device="cuda") / 45).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda") / 28).bfloat16()
    for tokens in args.tokens:
        x = torch.randn(tokens, h, device="cuda").bfloat16()
        weights, ids = triton_moe.route(torch.randn(tokens, e, device="cuda").bfloat16(), k,
                                        True, True)
        experts = int(torch.unique(ids).numel())
        nbytes = experts * 3 * h * i * 2 + tokens * h * 2 * 2
        args_ = (x, w13, w2, weights, None, None)
        inv = _graph_us(partial(triton_moe.fused_experts, *args_, ids=ids))
        row = {"bench": "moe_layer", "device": _device(), "tokens": tokens,
               "experts_hit": experts, "invariant_us": round(inv, 1),
               "invariant_GB_s": round(nbytes / inv / 1e3, 1),
               "ratio_to_copy_bandwidth": round(nbytes / inv * 1e6 / bandwidth, 3)}
        try:
            std = _graph_us(partial(ops_moe.experts_grouped_mm, *args_, ids=ids))
            row |= {"grouped_mm_us": round(std, 1),
                    "ratio_invariant_over_grouped_mm_time": round(inv / std, 3)}
        except RuntimeError as e:  # grouped_mm missing or not capturable here: say so
            row |= {"grouped_mm_error": str(e)[:200]}
        print(json.dumps(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=CONFIG)
    p.add_argument("--part", choices=["decode", "e2e", "layer", "all"], default="all")
    p.add_argument("--max-tokens", type=int, default=129, help="decode: new tokens per run")
    p.add_argument("--top", type=int, default=20, help="decode: kernels listed")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--gen-len", type=int, default=1024)
    p.add_argument("--enforce-eager", action="store_true", help="e2e: no CUDA graphs (A/B)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 64, 256, 2048],
                   help="layer: token counts")
    p.add_argument("--no-profile", action="store_true", help="decode: tok/s only")
    p.add_argument("--no-pdl", action="store_true",
                   help="launch without programmatic dependent launch: each kernel's profiled "
                        "time is then its own, not also its wait for the previous one")
    args = p.parse_args()
    if args.no_pdl:
        from samebits.ops.triton import launcher
        launcher._programmatic_device = lambda index: False
    bandwidth = copy_bandwidth()
    if args.part in ("layer", "all"):
        layer(args, bandwidth)
    if args.part in ("decode", "all"):
        decode(args, bandwidth)
        gc.collect()
        torch.cuda.empty_cache()
    if args.part in ("e2e", "all"):
        e2e(args)


if __name__ == "__main__":
    main()
