"""How long a running stream waits while another client's long prompt is prefilled.

Starts ``samebits serve`` (the default model unless --model), opens a streaming completion, and,
once it has produced some tokens, sends a second request with a --prompt-tokens prompt (token
ids). Prints one JSON line per --chunk value: the stream's largest gap between two tokens while
the long prompt was being prefilled, and the long request's time to its first token. ``--chunk 0``
runs the server with no prefill cap (the whole step budget), the control in the same run.

    PYTHONPATH=$PWD python benchmarks/prefill_gap.py --chunk 128 --chunk 0
"""

from __future__ import annotations

import argparse
import json
import platform
import threading
import time

import httpx

from tests.server.conftest import start_server


def _stream_gaps(url: str, started: threading.Event, stop: threading.Event,
                 out: list[float]) -> None:
    body = {"prompt": "Write a very long story about a lighthouse.", "max_tokens": 2000,
            "ignore_eos": True, "stream": True, "temperature": 0.0}
    last = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=3600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.monotonic()
            if last is not None:
                out.append((last, now))
            last = now
            if len(out) >= 3:
                started.set()
            if stop.is_set():
                return


def measure(chunk: int, prompt_tokens: int, max_model_len: int, model: str | None) -> dict:
    extra = ["--max-model-len", str(max_model_len)]
    if chunk:
        extra += ["--long-prefill-token-threshold", str(chunk)]
    else:
        extra += ["--long-prefill-token-threshold", "100000", "--max-num-batched-tokens",
                  str(max_model_len)]
    if model:
        extra += ["--model", model]
    gen = start_server(*extra, max_model_len=None)
    server = next(gen)
    try:
        started, stop, gaps = threading.Event(), threading.Event(), []
        streamer = threading.Thread(target=_stream_gaps, args=(server.url, started, stop, gaps))
        streamer.start()
        started.wait(600)
        prompt = [100 + (i * 7919) % 40000 for i in range(prompt_tokens)]
        t0 = time.monotonic()
        r = httpx.post(f"{server.url}/v1/completions", timeout=3600,
                       json={"prompt": prompt, "max_tokens": 1})
        t1 = time.monotonic()
        r.raise_for_status()
        stop.set()
        streamer.join(600)
        during = [b - a for a, b in gaps if b > t0 and a < t1]
        before = [b - a for a, b in gaps if b <= t0]
        return {"bench": "prefill_gap", "chunk": chunk or "none", "prompt_tokens": prompt_tokens,
                "max_gap_s": round(max(during), 3) if during else None,
                "median_gap_before_s": round(sorted(before)[len(before) // 2], 3),
                "long_prompt_ttft_s": round(t1 - t0, 2), "gaps_during": len(during),
                "machine": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                  time.gmtime())}
    finally:
        gen.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--chunk", type=int, action="append", default=None,
                   help="--long-prefill-token-threshold to test (0: no cap); repeatable")
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--model", default=None)
    args = p.parse_args()
    for chunk in args.chunk or [128, 0]:
        print(json.dumps(measure(chunk, args.prompt_tokens, args.max_model_len, args.model)),
              flush=True)


if __name__ == "__main__":
    main()
