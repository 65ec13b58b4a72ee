"""CPU server throughput under load: a real ``samebits serve`` per mode (invariant, then
``--standard``), closed-loop clients at each concurrency, JSON lines.

    PYTHONPATH=$PWD python benchmarks/server_load.py --concurrency 1 8 32 --requests 32

Each client sends /v1/completions (random-token prompts, greedy, ``ignore_eos``) one after another;
a line per (mode, concurrency): generated tokens/s over the wall time, request latency p50 / p99
(seconds). Then the ratio invariant / standard per concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time

import httpx

MODEL = "SmolLM2-135M-Instruct"  # the default model's served name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(standard: bool, threads: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    args = [sys.executable, "-m", "samebits.cli", "serve", "--host", "127.0.0.1", "--port",
            str(port), "--log-level", "warning", "--max-model-len", "1024"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    log = tempfile.NamedTemporaryFile("w", prefix="samebits-load-", suffix=".log", delete=False)
    proc = subprocess.Popen(args + (["--standard"] if standard else []), stdout=log,
                            stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"samebits serve exited; see {log.name}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("samebits serve not ready after 600 s")


async def _client(http: httpx.AsyncClient, queue: asyncio.Queue, out: list) -> None:
    while not queue.empty():
        body = queue.get_nowait()
        t0 = time.perf_counter()
        r = await http.post("/v1/completions", json=body)
        r.raise_for_status()
        out.append((time.perf_counter() - t0, r.json()["usage"]["completion_tokens"]))


async def load(url: str, concurrency: int, bodies: list[dict]) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    done: list[tuple[float, int]] = []
    async with httpx.AsyncClient(base_url=url, timeout=1800) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(_client(http, queue, done) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    lat = sorted(x[0] for x in done)
    return {"requests": len(done), "gen_tokens_per_s": round(sum(x[1] for x in done) / wall, 2),
            "p50_s": round(_pct(lat, 50), 3), "p99_s": round(_pct(lat, 99), 3)}


def _pct(xs: list[float], p: float) -> float:
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def _bodies(n: int, prompt_len: int, max_tokens: int) -> list[dict]:
    rng = random.Random(0)
    return [{"model": MODEL, "prompt": [rng.randrange(1000, 40000) for _ in range(prompt_len)],
             "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} for _ in range(n)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    rates: dict[tuple[str, int], float] = {}
    for mode in ("invariant", "standard"):
        proc, url = start(mode == "standard", args.threads)
        try:
            asyncio.run(load(url, 1, _bodies(1, args.prompt_len, 4)))  # warm-up
            for c in args.concurrency:
                r = asyncio.run(load(url, c, _bodies(max(args.requests, c), args.prompt_len,
                                                     args.max_tokens)))
                rates[mode, c] = r["gen_tokens_per_s"]
                print(json.dumps({"bench": "server_load", "mode": mode, "concurrency": c, **r}),
                      flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    for c in args.concurrency:
        print(json.dumps({"bench": "server_load", "concurrency": c, "ratio_invariant_over_standard":
                          round(rates["invariant", c] / rates["standard", c], 3)}))


if __name__ == "__main__":
    main()
