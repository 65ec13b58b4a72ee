"""Tensor parallel against one GPU in the same run, JSON lines.

    python benchmarks/tensor_parallel.py --model benchmarks/configs/qwen3-8b.json --tp 1 2

Each tensor-parallel size runs in a process of its own (the GPUs start empty; default memory
settings: ``gpu_memory_utilization=0.9``, the KV cache sized per rank), with dummy weights of the
config's shapes. Per size it prints the start seconds, each rank's weight bytes and KV blocks, then
per workload the generated tok/s and its ratio to the first size listed (TP 1): ``batch`` (64
requests of 1024 prompt tokens, 256 generated each, all submitted at once) and ``decode-bs1``
(one greedy request, 256 generated tokens after a 128-token prompt; each workload is run once
to warm up, then timed; ``--runs N``: N times, the median's tok/s reported with each run's),
then the seconds its shutdown took (bounded: the ranks exit when told, rank 0 releases its side
alone). Targets (issue: multi-GPU): batch >= 1.5x, decode-bs1 >=
1.3x at TP 2.
The bits agree across the sizes that share the backend's K chains (on CUDA TP 1 and TP 2: two
chains, ``row_parallel_chains``); ``tokens_sha`` lets the runs be compared. ``--one-chain``: TP 1
runs once more with one K chain per row-parallel linear (what one GPU ran before it ran TP 2's two
chains), and TP 1's default is reported as a ratio to it (``ratio_to_one_chain``: the chains' cost;
other tokens, as they must be). ``--push LEVEL ...``: every
size above 1 runs once per level with ``SAMEBITS_TP_PUSH=LEVEL`` (bare ``--push``: 1; default 2,
the engine's own at two ranks; 0: NCCL's gather;
row-parallel sums pushed through symmetric memory, ``samebits.distributed.symmetric``; 2: stored
into the peer by the GEMM itself, at TP 2), TP 1 once (a push needs peers); then per size and
workload each level's tok/s as a ratio to the first level listed (``ratio_to_push0`` for
``--push 0 1 2``) and whether its ``tokens_sha`` is that level's (it must be: the same bits).

    python benchmarks/tensor_parallel.py --tp 2 --push 0 1 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

WORKLOADS = {"batch": (64, 1024, 256), "decode-bs1": (1, 128, 256)}  # requests, prompt, generated


def run_size(args: argparse.Namespace, tp: int) -> None:
    """One tensor-parallel size, in this process: a JSON line per workload."""
    import torch

    from samebits import LLM, SamplingParams
    if args.one_chain_child:  # one K chain per row-parallel linear (C = N)
        from samebits.ops.backend import one_chain_per_rank
        from samebits.ops.triton.backend import TritonBackend
        TritonBackend.row_parallel_chains = staticmethod(one_chain_per_rank)
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", dtype=args.dtype, tensor_parallel_size=tp,
              max_num_seqs=64, max_model_len=args.max_model_len, enable_prefix_caching=False,
              max_piecewise_tokens=args.max_piecewise_tokens)
    runner = llm.engine.runner
    o_proj = runner.model.layers[0].self_attn.o_proj  # every decoder's; an MoE layer has no down_proj
    print(json.dumps({"tp": tp, "push": os.environ.get("SAMEBITS_TP_PUSH", ""),
                      "k_chains": tp * len(o_proj.k_bounds),
                      "start_s": round(time.perf_counter() - t0, 1),
                      "weight_gib_per_rank": [round(b / 2**30, 3) for b in runner.weight_bytes()],
                      "kv_blocks": runner.num_blocks,
                      "graphs": 0 if runner.graphs is None else len(runner.graphs.graphs),
                      "piecewise_buckets": 0 if runner.piecewise is None
                      else len(runner.piecewise.chains),
                      "device": torch.cuda.get_device_name(0) if torch.cuda.is_available()
                      else "cpu"}), flush=True)
    vocab = llm.engine.loaded.model_config.vocab_size
    for name, (n, prompt, gen) in WORKLOADS.items():
        n, prompt, gen = max(1, int(n * args.scale)), int(prompt * args.scale), int(gen * args.scale)
        prompts = [[(7 * i + j) % (vocab - 1) + 1 for j in range(prompt)] for i in range(n)]
        params = SamplingParams(max_tokens=gen, ignore_eos=True, temperature=0.0)
        llm.generate(prompts, params)  # warm-up (no prefix caching: the timed run recomputes)
        seconds, ids = _timed(llm, prompts, params, args.runs)
        print(json.dumps({"tp": tp, "k_chains": tp * len(o_proj.k_bounds), "workload": name,
                          "requests": n, "prompt": prompt,
                          "generated": gen, "seconds": round(statistics.median(seconds), 3),
                          "tok_s": round(len(ids) / statistics.median(seconds), 1),
                          "runs_tok_s": [round(len(ids) / s, 1) for s in seconds],
                          "tokens_sha": hashlib.sha256(str(ids).encode()).hexdigest()[:16]}),
              flush=True)
    start = time.perf_counter()
    runner.shutdown()
    print(json.dumps({"tp": tp, "shutdown_s": round(time.perf_counter() - start, 2)}), flush=True)


def _timed(llm, prompts: list[list[int]], params, runs: int) -> tuple[list[float], list[int]]:
    """Each of ``runs`` timed runs' seconds, and the generated ids (every run's must be the
    first's: the same bits)."""
    seconds, first = [], None
    for _ in range(runs):
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds.append(time.perf_counter() - start)
        ids = [t for o in outs for t in o.outputs[0].token_ids]
        if first is not None and ids != first:
            raise RuntimeError("a repeated run generated other tokens")
        first = ids
    return seconds, first


def _text(out: str | bytes | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def _print_lines(out: str | bytes | None) -> None:
    """A stopped child's JSON lines (they are flushed as they are printed)."""
    for line in _text(out).splitlines():
        if line.startswith("{"):
            print(line, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="benchmarks/configs/qwen3-8b.json")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--scale", type=float, default=1.0,
                   help="scale every workload's requests and lengths (a quick check on CPU)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds each size may take (start, workloads, shutdown) before it is "
                        "stopped and reported as an error")
    p.add_argument("--runs", type=int, default=1,
                   help="timed runs of each workload after its warm-up; tok/s is the median's")
    p.add_argument("--max-piecewise-tokens", type=int, default=2048,
                   help="the engine's option: prefill and mixed steps of up to this many tokens "
                        "replay piecewise CUDA graphs; 0: eager")
    p.add_argument("--push", type=int, nargs="*", default=[2], choices=(0, 1, 2),
                   help="SAMEBITS_TP_PUSH levels, each a run of every size above 1 (bare: 1)")
    p.add_argument("--one-chain", action="store_true",
                   help="also run TP 1 with one K chain per row-parallel linear")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child's size
    p.add_argument("--one-chain-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    levels = args.push or [1]
    if args.one is not None:  # a child: its lines are printed; skip the interpreter's teardown
        run_size(args, args.one)
        sys.stderr.flush()
        os._exit(0)
    lines: list[dict] = []
    for tp in args.tp:
        for level in levels if tp > 1 else levels[:1]:
            lines += _run_child(args, tp, level)
    chain = _run_child(args, 1, levels[0], one_chain=True) if args.one_chain else []
    first = str(levels[0])
    for d in (x for x in lines if "workload" in x and x["tp"] == 1):
        _ratio(d, _match(chain, d), "ratio_to_one_chain")
    for d in (x for x in lines if "workload" in x):
        if d["push"] == first and d["tp"] != args.tp[0]:  # against the first size
            _ratio(d, _match(lines, d, tp=args.tp[0]), f"ratio_to_tp{args.tp[0]}")
        elif d["push"] != first:  # against the first level, same size
            _ratio(d, _match(lines, d, tp=d["tp"], push=first), f"ratio_to_push{first}")


def _run_child(args: argparse.Namespace, tp: int, level: int, one_chain: bool = False
               ) -> list[dict]:
    """One size at one push level (``one_chain``: with one K chain) in a process of its own
    (its ranks inherit ``SAMEBITS_TP_PUSH``): its JSON lines, printed as they come, each with
    its ``push``."""
    cmd = [sys.executable, __file__, "--model", args.model, "--dtype", args.dtype,
           "--max-model-len", str(args.max_model_len), "--scale", str(args.scale),
           "--max-piecewise-tokens", str(args.max_piecewise_tokens), "--runs", str(args.runs),
           "--one", str(tp), *(["--one-chain-child"] if one_chain else [])]
    env = {**os.environ, "SAMEBITS_TP_PUSH": str(level)}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=False,
                             timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired as e:  # the lines it printed, then the error
        _print_lines(e.stdout)
        print(json.dumps({"tp": tp, "push": level, "error": f"no result within {args.timeout} s",
                          "stderr": _text(e.stderr)[-2000:]}), flush=True)
        return []
    if out.returncode:
        print(json.dumps({"tp": tp, "push": level, "error": out.stderr.strip()[-2000:]}),
              flush=True)
        return []
    lines = []
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            print(line, flush=True)
            lines.append({**json.loads(line), "push": str(level)})
    return lines


def _match(lines: list[dict], d: dict, **fields: object) -> dict | None:
    """The line of ``d``'s workload whose ``fields`` are these."""
    return next((x for x in lines if x.get("workload") == d["workload"]
                 and all(x.get(k) == v for k, v in fields.items())), None)


def _ratio(d: dict, ref: dict | None, name: str) -> None:
    """``d``'s tok/s as a ratio to ``ref``'s (the same workload) and whether their tokens
    match; nothing where ``ref`` did not run."""
    if ref is not None:
        print(json.dumps({"workload": d["workload"], "tp": d["tp"], "push": d["push"],
                          name: round(d["tok_s"] / ref["tok_s"], 3),
                          "same_tokens": d["tokens_sha"] == ref["tokens_sha"]}), flush=True)

if __name__ == "__main__":
    main()
