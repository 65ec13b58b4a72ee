"""Cost of the per-request logits processors per sampling step, against the step's own
log_softmax of the same logits (measured in the same run). JSON lines.

    python benchmarks/logits_processors.py [--device cuda] [--vocab 151936]

Kinds: ``none`` (the fast path: nothing uses a processor), ``bias`` (20 biased tokens per row),
``penalties`` (all three penalties over a 512-token prompt and 256 generated tokens per row),
``all`` (both, and min_tokens).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from samebits.engine.logits_processor import apply_logits_processors
from samebits.engine.sequence import Sequence
from samebits.sampling_params import SamplingParams

KINDS = {
    "none": {},
    "bias": {"logit_bias": {t: 1.5 for t in range(100, 2100, 100)}},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.1},
    "all": {"logit_bias": {t: 1.5 for t in range(100, 2100, 100)}, "presence_penalty": 0.5,
            "frequency_penalty": 0.3, "repetition_penalty": 1.1, "min_tokens": 512},
}


def _seqs(batch: int, vocab: int, kind: dict) -> list[Sequence]:
    rng = random.Random(0)
    return [Sequence(f"r{i}", [rng.randrange(vocab) for _ in range(512)],
                     SamplingParams(max_tokens=1024, **kind), 0,
                     output_token_ids=[rng.randrange(vocab) for _ in range(256)],
                     stop_ids=frozenset({0, 2})) for i in range(batch)]


def _time(fn, device: torch.device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    for batch in args.batches:
        logits = torch.randn(batch, args.vocab, device=dev)
        base = _time(lambda: torch.log_softmax(logits, -1), dev, args.reps)  # noqa: B023
        for name, kind in KINDS.items():
            seqs = _seqs(batch, args.vocab, kind)
            t = _time(lambda: apply_logits_processors(logits, seqs), dev, args.reps)  # noqa: B023
            print(json.dumps({"bench": "logits_processors", "device": args.device,
                              "batch": batch, "vocab": args.vocab, "kind": name,
                              "ms": round(t * 1e3, 3),
                              "ratio_to_log_softmax": round(t / base, 3)}), flush=True)


if __name__ == "__main__":
    main()
