"""CPU side by side: invariant samebits, standard samebits and Hugging Face transformers
``generate`` on the same model, prompts and greedy decoding, at each batch size, in one run.

Each line: engine, batch, and two rates, medians of ``--repeats`` interleaved rounds: ``decode``
tokens/s, batch x (max_tokens - 1) / (t(max_tokens) - t(1)) -- the generate with one new token
(prefill and first token) timed beside the full one, so prefill cancels -- and ``e2e`` tokens/s,
the whole generate. Then per batch the ratios invariant / standard and invariant / transformers
of both. transformers is optional: without it those lines say it was skipped.
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

Runner = Callable[[int], int]  # max_tokens -> tokens generated


def _prompts(vocab: int, batch: int, prompt_len: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]


def _samebits_runner(llm: LLM, prompts: list[list[int]]) -> Runner:
    def run(max_tokens: int) -> int:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False))
    return run


def _hf_model(model_dir: str):
    """The HF model on CPU in fp32, or None when transformers is not installed."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_runner(model, prompts: list[list[int]]) -> Runner:
    ids = torch.tensor(prompts)

    @torch.inference_mode()
    def run(max_tokens: int) -> int:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             pad_token_id=0)
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return run


def _timed(run: Runner, max_tokens: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = run(max_tokens)
    return n, time.perf_counter() - t0


def _rates(run: Runner, batch: int, max_tokens: int) -> tuple[float, float]:
    """(decode tok/s, e2e tok/s) of one round: a one-token generate, then the full one."""
    _, first = _timed(run, 1)
    n, full = _timed(run, max_tokens)
    return batch * (max_tokens - 1) / (full - first), n / full


def side_by_side(args: argparse.Namespace) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        _side_by_side(args)
    finally:
        torch.set_num_threads(threads)


def _side_by_side(args: argparse.Namespace) -> None:
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
        runs = {m: _samebits_runner(llm, prompts) for m, llm in engines.items()}
        if hf is not None:
            runs["transformers"] = _hf_runner(hf, prompts)
        _report(batch, _measure(runs, batch, args), args)


def _measure(runs: dict[str, Runner], batch: int,
             args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """Interleaved: every engine once per round (after a warm-up), so load spikes hit all."""
    for run in runs.values():
        run(2)
    rates = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            rates[name].append(_rates(run, batch, args.max_tokens))
    return rates


def _report(batch: int, rates: dict[str, list[tuple[float, float]]],
            args: argparse.Namespace) -> None:
    med = {name: (statistics.median(d for d, _ in r), statistics.median(e for _, e in r))
           for name, r in rates.items()}
    for name, r in rates.items():
        print(json.dumps({"bench": "cpu", "engine": name, "batch": batch, "threads": args.threads,
                          "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                          "decode_tokens_per_s": round(med[name][0], 2),
                          "e2e_tokens_per_s": round(med[name][1], 2),
                          "decode_runs": [round(d, 2) for d, _ in r]}), flush=True)
    ratios = {}
    for i, kind in enumerate(("decode", "e2e")):
        for a, b in (("invariant", "standard"), ("invariant", "transformers"),
                     ("standard", "transformers")):
            if b in med:
                ratios[f"{kind}_{a}_over_{b}"] = round(med[a][i] / med[b][i], 3)
    print(json.dumps({"bench": "cpu", "batch": batch, **ratios}), flush=True)
