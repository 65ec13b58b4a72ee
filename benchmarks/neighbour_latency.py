"""How much the worst request the limits allow slows its neighbours: a plain stream's inter-token
latency beside K such requests, as a ratio to the same stream alone (and to the stream beside K
plain requests, which separates the hostile parameters' cost from the batch size's), JSON lines.

    PYTHONPATH=$PWD python benchmarks/neighbour_latency.py [--url URL] [--neighbours 8]
        [--tokens 64] [--repeats 3]

Without ``--url`` it starts ``samebits serve --max-model-len 1024`` (the default model, CPU).
Scenarios, each neighbour at the limits of ``samebits.sampling_params`` and
``samebits.engine.grammar_limits`` (docs/LIMITS.md):

- ``plain``: plain neighbours (the batch-size cost alone)
- ``stop_strings``: 64 stop strings of 1,024 characters each
- ``logit_bias``: 1,024 logit_bias entries
- ``stop_token_ids``: 1,024 stop token ids, masked at every step by ``min_tokens``
- ``penalties``: presence, frequency and repetition penalties
- ``json_schema``: a JSON schema of 256 properties
- ``everything``: all of these in every neighbour

A line per scenario: the measured stream's median and p90 gap between token chunks beside the
neighbours and alone (alone measured before and after, in the same run), ``ratio_to_alone`` and
``ratio_to_plain`` (medians). The stream is greedy with ``ignore_eos``; neighbours run until the
measurement ends, then are cancelled (their clients disconnect).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx
from serve_process import metric, start, stop

MODEL = "SmolLM2-135M-Instruct"
STOPS = [f"{i:03d}" + "\u2603" * 1021 for i in range(64)]  # never generated
SCHEMA = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 8}
                                           for i in range(256)},
          "required": [f"field_{i}" for i in range(256)]}
SCENARIOS = {
    "plain": {},
    "stop_strings": {"stop": STOPS},
    "logit_bias": {"logit_bias": {str(i): 0.01 for i in range(1000, 2024)}},
    "stop_token_ids": {"stop_token_ids": list(range(47000, 48024)), "min_tokens": 900},
    "penalties": {"presence_penalty": 1.0, "frequency_penalty": 1.0, "repetition_penalty": 1.2},
    "json_schema": {"structured_outputs": {"json": SCHEMA}},
}
SCENARIOS["everything"] = {k: v for body in SCENARIOS.values() for k, v in body.items()}


async def _stream(http: httpx.AsyncClient, url: str, body: dict) -> list[float]:
    """Arrival times of a stream's chunks."""
    times = []
    async with http.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    return times


async def _neighbour(http: httpx.AsyncClient, url: str, extra: dict, i: int) -> None:
    body = {"model": MODEL, "prompt": f"Neighbour {i}: write a long story.", "max_tokens": 900,
            "ignore_eos": True, "temperature": 0.8, "seed": i, **extra}
    await _stream(http, url, body)


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times[1:], times[2:], strict=False)]  # after the first token


async def _measured(http: httpx.AsyncClient, url: str, tokens: int) -> list[float]:
    body = {"model": MODEL, "prompt": "The measured stream counts slowly:", "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0.0}
    return _gaps(await _stream(http, url, body))


async def _beside(http: httpx.AsyncClient, url: str, extra: dict, k: int, tokens: int
                  ) -> list[float]:
    tasks = [asyncio.create_task(_neighbour(http, url, extra, i)) for i in range(k)]
    deadline = time.monotonic() + 300
    while metric(url, "samebits_num_requests_running") < k and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    try:
        return await _measured(http, url, tokens)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        while metric(url, "samebits_num_requests_running") > 0:
            await asyncio.sleep(0.05)


def _summary(gaps: list[float]) -> dict[str, float]:
    q = statistics.quantiles(gaps, n=10)
    return {"median_ms": statistics.median(gaps) * 1e3, "p90_ms": q[-1] * 1e3}


async def run(url: str, k: int, tokens: int, repeats: int) -> None:
    async with httpx.AsyncClient(timeout=None) as http:
        await _measured(http, url, 4)  # warm up
        alone = []
        for _ in range(repeats):
            alone += await _measured(http, url, tokens)
        beside = {}
        for name, extra in SCENARIOS.items():
            gaps = []
            for _ in range(repeats):
                gaps += await _beside(http, url, extra, k, tokens)
            beside[name] = _summary(gaps)
        for _ in range(repeats):
            alone += await _measured(http, url, tokens)
    solo = _summary(alone)
    print(json.dumps({"scenario": "alone", **solo, "tokens": tokens, "repeats": repeats}))
    for name, s in beside.items():
        print(json.dumps({"scenario": name, "neighbours": k, **s,
                          "alone_median_ms": solo["median_ms"],
                          "ratio_to_alone": s["median_ms"] / solo["median_ms"],
                          "ratio_to_plain": s["median_ms"] / beside["plain"]["median_ms"]}),
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (default: start one)")
    ap.add_argument("--neighbours", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="tokens of the measured stream")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start("--max-model-len", "1024")
    try:
        asyncio.run(run(url, args.neighbours, args.tokens, args.repeats))
    finally:
        if proc is not None:
            stop(proc)


if __name__ == "__main__":
    main()
