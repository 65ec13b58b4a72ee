"""CPU side by side: invariant samebits, standard samebits and Hugging Face transformers
``generate`` on the same model, prompts and greedy decoding, at each batch size, in one run.

Each line: engine, batch, generated tokens/s (median of ``--repeats`` interleaved runs, each the
whole generate: prefill and decode); then per batch the ratios invariant / standard and
invariant / transformers. transformers is optional: without it those lines say it was skipped.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch

from samebits import LLM, SamplingParams


def _prompts(vocab: int, batch: int, prompt_len: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]


def _samebits_runner(llm: LLM, prompts: list[list[int]], max_tokens: int) -> Callable[[], int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def run() -> int:
        return sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False))
    return run


def _hf_model(model_dir: str):
    """The HF model on CPU in fp32, or None when transformers is not installed."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_runner(model, prompts: list[list[int]], max_tokens: int) -> Callable[[], int]:
    ids = torch.tensor(prompts)

    @torch.inference_mode()
    def run() -> int:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             pad_token_id=0)
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return run


def _tok_per_s(run: Callable[[], int]) -> float:
    t0 = time.perf_counter()
    n = run()
    return n / (time.perf_counter() - t0)


def side_by_side(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    engines = {mode: LLM(args.model, load_format=args.load_format, device="cpu", dtype="float32",
                         batch_invariant=mode == "invariant", enable_prefix_caching=False,
                         max_num_seqs=max(args.batch_sizes))
               for mode in ("invariant", "standard")}
    loaded = engines["invariant"].engine.loaded
    hf = _hf_model(str(loaded.model_dir))
    if hf is None:
        print(json.dumps({"bench": "cpu", "engine": "transformers",
                          "skipped": "transformers is not installed (pip install transformers)"}))
    for batch in args.batch_sizes:
        prompts = _prompts(loaded.model_config.vocab_size, batch, args.prompt_len)
        runs = {m: _samebits_runner(llm, prompts, args.max_tokens) for m, llm in engines.items()}
        if hf is not None:
            runs["transformers"] = _hf_runner(hf, prompts, args.max_tokens)
        _report(batch, _measure(runs, args.repeats), args)


def _measure(runs: dict[str, Callable[[], int]], repeats: int) -> dict[str, list[float]]:
    """Interleaved: every engine once per round (after a warm-up), so load spikes hit all."""
    for run in runs.values():
        run()
    rates = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            rates[name].append(_tok_per_s(run))
    return rates


def _report(batch: int, rates: dict[str, list[float]], args: argparse.Namespace) -> None:
    med = {name: statistics.median(r) for name, r in rates.items()}
    for name, r in rates.items():
        print(json.dumps({"bench": "cpu", "engine": name, "batch": batch, "threads": args.threads,
                          "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                          "gen_tokens_per_s": round(med[name], 2),
                          "runs": [round(x, 2) for x in r]}), flush=True)
    ratios = {"invariant_over_standard": round(med["invariant"] / med["standard"], 3)}
    if "transformers" in med:
        ratios["invariant_over_transformers"] = round(med["invariant"] / med["transformers"], 3)
        ratios["standard_over_transformers"] = round(med["standard"] / med["transformers"], 3)
    print(json.dumps({"bench": "cpu", "batch": batch, **ratios}), flush=True)
