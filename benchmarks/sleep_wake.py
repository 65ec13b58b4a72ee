"""Sleep mode for colocated RL: memory given back and the cost of waking, JSON lines.

    python benchmarks/sleep_wake.py --model benchmarks/configs/qwen3-8b.json --load-format dummy \
        --gpu-memory-utilization 0.5

For each level: the device memory ``sleep`` frees (GiB, and as a ratio of what the KV cache and
the weights hold: the physical limit), the seconds of ``sleep`` and ``wake_up`` (waking re-captures
the decode CUDA graphs: as a ratio of the engine's first capture, measured in the same run), and
the decode tok/s of the same batch after waking against before (target 1.0: nothing is slower).
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from samebits import LLM, SamplingParams


def _used() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _tok_s(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / (time.perf_counter() - t), [o.outputs[0].token_ids for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="benchmarks/configs/qwen3-8b.json")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    llm = LLM(args.model, load_format=args.load_format, device="cuda",
              gpu_memory_utilization=args.gpu_memory_utilization, enable_sleep_mode=True,
              enable_prefix_caching=False)
    runner = llm.engine.runner
    capture = runner.graphs.capture_seconds if runner.graphs is not None else None
    kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in runner.kv_caches)
    weights = sum(q.numel() * q.element_size() for q in llm.engine.loaded.model.parameters())
    prompts = [[(7 * i + j) % 5000 + 2 for j in range(256)] for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    _tok_s(llm, prompts, params)  # warm
    base, want = _tok_s(llm, prompts, params)
    for level in (1, 2):
        awake = _used()
        t = time.perf_counter()
        llm.sleep(level=level)
        slept = time.perf_counter() - t
        freed = awake - _used()
        t = time.perf_counter()
        llm.wake_up()
        woke = time.perf_counter() - t
        tok_s, got = _tok_s(llm, prompts, params)
        limit = kv_bytes + (weights if level == 2 else 0)
        print(json.dumps({"bench": "sleep_wake", "level": level,
                          "freed_gib": round(freed / 2**30, 3),
                          "freed_vs_kv_and_weights": round(freed / limit, 3),
                          "sleep_s": round(slept, 3), "wake_s": round(woke, 3),
                          "wake_vs_first_capture": None if not capture else round(woke / capture, 3),
                          "tok_s_after_vs_before": round(tok_s / base, 3),
                          "bitwise_equal": got == want}), flush=True)


if __name__ == "__main__":
    main()
