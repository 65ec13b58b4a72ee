"""Where a CPU decode step's time goes, invariant against standard, same run, JSON lines.

    PYTHONPATH=$PWD python benchmarks/profile_cpu.py --batch 1 16 --steps 24

For each mode and batch size: requests are prefilled, then ``--steps`` decode steps are timed as a
whole, with the backend's ops (linear, attention, norm, log_softmax) and the sampler timed inside
them (``sampling`` includes ``log_softmax``); ``other`` is the rest of the step (Python
bookkeeping, embedding, RoPE, SiLU, residuals).
Milliseconds per step.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict

import torch

from samebits import LLM, SamplingParams
from samebits.engine import runner as runner_mod

OPS = {"linear": "linear", "attention": "attention", "rms_norm": "norm", "log_softmax": "log_softmax"}


def _timed(fn, bucket: str, totals: dict[str, float]):
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        totals[bucket] += time.perf_counter() - t0
        return out
    return wrapped


def profile(llm: LLM, batch: int, steps: int, prompt_len: int) -> dict:
    engine, totals = llm.engine, defaultdict(float)
    ops = engine.runner.model.ops
    saved = {name: getattr(ops, name) for name in OPS}
    for name, bucket in OPS.items():
        setattr(ops, name, _timed(saved[name], bucket, totals))
    sample = runner_mod.sampler.sample
    runner_mod.sampler.sample = _timed(sample, "sampling", totals)
    rng = random.Random(batch)
    vocab = engine.loaded.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    try:
        for i in range(batch):
            engine.add_request(f"p{batch}-{i}", [rng.randrange(vocab) for _ in range(prompt_len)],
                               params)
        started: set[str] = set()
        while len(started) < batch:  # every prefill chunk, until each request has a token
            started |= {s.request_id for s in engine.step() if s.output_token_ids}
        totals.clear()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step_s = (time.perf_counter() - t0) / steps
        while engine.has_unfinished():
            engine.step()
    finally:
        for name in OPS:
            setattr(ops, name, saved[name])
        runner_mod.sampler.sample = sample
    ms = {k: round(v / steps * 1e3, 2) for k, v in totals.items()}
    inside = sum(v for k, v in ms.items() if k != "log_softmax")  # sampling includes log_softmax
    ms["other"] = round(step_s * 1e3 - inside, 2)
    return {"step_ms": round(step_s * 1e3, 2), **ms}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    for invariant in (True, False):
        llm = LLM(batch_invariant=invariant, enable_prefix_caching=False)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up (kernel build, caches)
        for b in args.batch:
            r = profile(llm, b, args.steps, args.prompt_len)
            print(json.dumps({"bench": "profile_cpu", "mode": "invariant" if invariant else "standard",
                              "batch": b, **r}), flush=True)


if __name__ == "__main__":
    main()
