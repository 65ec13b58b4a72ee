"""What the determinism canary costs: the same bursty workload against ``samebits serve`` at
canary rate 0 (off), the default 0.01, and 1.0 (every request replayed) -- JSON lines.

    python benchmarks/canary.py                          # 8 waves x 16 requests, rates 0,0.01,1
    python benchmarks/canary.py --waves 4 --concurrency 8 --rates 0,0.01

Each wave sends ``concurrency`` seeded completions at once, then pauses ``--pause`` seconds (the
idle time the canary replays in). Servers run one after another in this process's run, each for
``--rounds`` rounds, alternating, so the ratios compare like with like. Per line: the rate, wall
time of the workload, mean and p95 request latency, canary checks and mismatches; the last line
gives the ratios to rate 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

LOG = open(os.path.join(tempfile.gettempdir(), "samebits-canary-bench.log"), "a")  # servers' logs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(rate: float, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "samebits.cli", "serve", "--port", str(port),
                             "--log-level", "error", "--canary-rate", str(rate),
                             "--max-model-len", "1024", *extra],
                            stdout=LOG, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


def metric(url: str, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            if s.name == name:
                return s.value
    return 0.0


async def workload(url: str, args: argparse.Namespace) -> list[float]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                timeout=600)

    async def one(i: int) -> float:
        t = time.perf_counter()
        await client.completions.create(model="SmolLM2-135M-Instruct", max_tokens=args.max_tokens,
                                        prompt=f"Note {i}: the weather in town {i % 13} is",
                                        temperature=0.8, seed=i)
        return time.perf_counter() - t

    latencies: list[float] = []
    async with client:
        for w in range(args.waves):
            base = w * args.concurrency
            latencies += await asyncio.gather(*(one(base + i) for i in range(args.concurrency)))
            await asyncio.sleep(args.pause)
    return latencies


def measure(rate: float, args: argparse.Namespace) -> dict:
    proc, url = start(rate, args.server_args.split())
    try:
        t = time.perf_counter()
        lat = asyncio.run(workload(url, args))
        wall = time.perf_counter() - t
        return dict(rate=rate, wall_s=round(wall, 3), mean_latency_s=round(statistics.mean(lat), 4),
                    p95_latency_s=round(sorted(lat)[int(0.95 * (len(lat) - 1))], 4),
                    requests=len(lat), canary_checks=metric(url, "samebits_canary_checks_total"),
                    canary_mismatches=metric(url, "samebits_canary_mismatches_total"))
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="0,0.01,1")
    p.add_argument("--waves", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--pause", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--server-args", default="", help="extra samebits serve arguments")
    args = p.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    runs: dict[float, list[dict]] = {r: [] for r in rates}
    for _ in range(args.rounds):
        for r in rates:
            row = measure(r, args)
            runs[r].append(row)
            print(json.dumps(row), flush=True)
    base = statistics.mean(x["wall_s"] for x in runs[rates[0]])
    base_lat = statistics.mean(x["mean_latency_s"] for x in runs[rates[0]])
    print(json.dumps({"summary": "ratio to rate " + str(rates[0]), **{
        f"rate_{r}": dict(wall=round(statistics.mean(x["wall_s"] for x in runs[r]) / base, 3),
                          mean_latency=round(statistics.mean(x["mean_latency_s"]
                                                             for x in runs[r]) / base_lat, 3))
        for r in rates}}))


if __name__ == "__main__":
    main()
