"""Shared prompts and the reference run for the determinism suite (real default model, CPU, fp32).

The reference is every request run *alone* (``max_num_seqs=1``); every other arrangement must
reproduce its token ids and logprobs bit for bit.
"""

from __future__ import annotations

import random

from samebits import LLM, SamplingParams

NUM_PROMPTS = 32
MAX_TOKENS = 32
_TEXT = (
    "Reproducible inference means that the same request returns the same answer. "
    "Floating-point addition is not associative, so the order of a sum changes its last bits. "
    "A kernel that picks its tiling from the batch size changes that order. "
    "In 1969, the first message on the ARPANET was 'lo'; the system crashed after two letters. "
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    "Les chats dorment seize heures par jour, et personne ne sait vraiment pourquoi. "
    "The quick brown fox jumps over the lazy dog 3 times, then 14 times, then 159 times. "
)


def prompt_token_ids(llm: LLM) -> list[list[int]]:
    """32 prompts of 10 to 300 tokens; some share long prefixes (prefix-cache hits in a batch)."""
    corpus = llm.tokenizer.encode(_TEXT * 12)
    lengths = [10 + (290 * i) // (NUM_PROMPTS - 1) for i in range(NUM_PROMPTS)]
    prompts = []
    for i, n in enumerate(lengths):
        start = 0 if i % 4 == 0 else 7 * i  # every fourth prompt starts at the shared prefix
        prompts.append(corpus[start:start + n])
    return prompts


def requests(prompts: list[list[int]]) -> list[tuple[list[int], SamplingParams]]:
    """Even prompts greedy, odd ones sampled (temperature 0.8, top_p 0.95, each its own seed)."""
    out = []
    for i, p in enumerate(prompts):
        if i % 2 == 0:
            out.append((p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)))
        else:
            out.append((p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95,
                                          seed=1000 + i)))
    return out


def run_shuffled(llm: LLM, reqs: list[tuple[list[int], SamplingParams]], shuffle_seed: int | None
                 ) -> list[tuple[list[int], list[float]]]:
    """Submit ``reqs`` in a shuffled order; return (token_ids, logprobs) in the original order."""
    order = list(range(len(reqs)))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    outs = llm.generate([reqs[i][0] for i in order], [reqs[i][1] for i in order])
    result: list = [None] * len(reqs)
    for i, o in zip(order, outs, strict=True):
        result[i] = (o.outputs[0].token_ids, o.outputs[0].token_logprobs)
    return result


