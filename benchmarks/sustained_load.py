"""Sustained mixed load on ``samebits serve``: N requests (plain, streamed, constrained,
penalised, embeddings) at a fixed concurrency, clients disconnecting at random; JSON lines.

    PYTHONPATH=$PWD python benchmarks/sustained_load.py [--n 2000] [--concurrency 32]
        [--disconnect 0.1] [--distinct 100] [--url URL --pid PID]

Without ``--url`` it starts ``samebits serve --embed-model DEFAULT --max-model-len 1024`` (the
default models, CPU) and watches its resident memory. The requests are drawn (seeded) from
``--distinct`` request specs, so each spec is sent many times. Checks:

- no 5xx (a 4xx is counted too: every spec is valid);
- no leaked KV blocks: once idle, ``samebits_kv_blocks_in_use`` is back to 0;
- resident memory flat: after a warm-up of ``--warmup`` requests (default twice the
  concurrency, not counted in N), its level once idle after the N requests is within 100 MB of
  its level once idle after the warm-up (the highest sample during the load is reported too);
- bits: every completed request equals its spec sent alone afterwards (output hash for
  generations, the base64 vectors for embeddings).

A line per kind (completed, disconnected, 4xx, 5xx, latency p50 / p99 in seconds), then a summary
line with ``ok``; the exit status is 0 only when ``ok``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
from serve_process import metric, rss_mb, start, stop

MODEL, EMBED_MODEL = "SmolLM2-135M-Instruct", "all-MiniLM-L6-v2"
RSS_FLAT_MB = 100
TOPICS = ["the sea", "a small robot", "bread", "winter mornings", "prime numbers", "a lighthouse",
          "trains", "the moon", "gardens", "an old map"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}


@dataclass(frozen=True)
class Spec:
    kind: str
    path: str
    body: dict
    stream: bool = False


def make_specs(n: int, seed: int) -> list[Spec]:
    rng = random.Random(seed)
    kinds = ["plain", "streamed", "constrained", "penalised", "embeddings"]
    return [_spec(kinds[i % len(kinds)], rng, i) for i in range(n)]


def _spec(kind: str, rng: random.Random, i: int) -> Spec:
    topic = rng.choice(TOPICS)
    base = {"model": MODEL, "max_tokens": rng.randint(4, 24), "temperature": 0.8, "seed": i}
    if kind == "plain":
        return Spec(kind, "/v1/completions", {**base, "prompt": f"A few words about {topic}:"})
    if kind == "streamed":
        return Spec(kind, "/v1/chat/completions", {**base, "stream": True, "messages": [
            {"role": "user", "content": f"Tell me about {topic}."}]}, stream=True)
    if kind == "constrained":
        constraint = ({"guided_json": SCHEMA} if i % 2 else
                      {"guided_choice": ["yes", "no", "maybe"]})
        return Spec(kind, "/v1/completions", {**base, "prompt": f"Is {topic} nice? ",
                                              **constraint})
    if kind == "penalised":
        return Spec(kind, "/v1/completions", {
            **base, "prompt": f"List things about {topic}:", "presence_penalty": 0.5,
            "frequency_penalty": 0.3, "repetition_penalty": 1.1,
            "logit_bias": {str(rng.randint(100, 40000)): 2.0}})
    texts = [f"{topic} number {rng.randint(0, 99)}" for _ in range(rng.randint(1, 4))]
    return Spec(kind, "/v1/embeddings", {"model": EMBED_MODEL, "input": texts,
                                         "encoding_format": "base64"})


async def send(http: httpx.AsyncClient, url: str, spec: Spec) -> tuple[int, str | None]:
    """(status, the response's bits as a hash; None unless 200)."""
    if spec.stream:
        async with http.stream("POST", url + spec.path, json=spec.body) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, None
            bits, status = None, 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        status = 500 if event["error"]["type"] == "server_error" else 400
                    bits = event.get("output_hash") or bits
            return status, bits
    r = await http.post(url + spec.path, json=spec.body)
    if r.status_code != 200:
        return r.status_code, None
    if spec.kind == "embeddings":
        vectors = "".join(d["embedding"] for d in r.json()["data"])
        return 200, hashlib.sha256(vectors.encode()).hexdigest()
    return 200, r.headers.get("X-Samebits-Output-Hash")


@dataclass
class Tally:
    latencies: dict[str, list[float]] = field(default_factory=dict)
    disconnected: dict[str, int] = field(default_factory=dict)
    status: dict[str, dict[int, int]] = field(default_factory=dict)
    bits: dict[int, set[str]] = field(default_factory=dict)  # spec index -> bits seen
    rss: list[float] = field(default_factory=list)


async def _client(http, url, specs, queue, tally, rng, disconnect) -> None:
    while True:
        try:
            i = queue.get_nowait()
        except asyncio.QueueEmpty:
            return
        spec, t = specs[i], time.monotonic()
        try:
            leave = rng.uniform(0.0, 0.5) if rng.random() < disconnect else None
            status, bits = await asyncio.wait_for(send(http, url, spec), leave)
        except TimeoutError:
            tally.disconnected[spec.kind] = tally.disconnected.get(spec.kind, 0) + 1
            continue
        counts = tally.status.setdefault(spec.kind, {})
        counts[status] = counts.get(status, 0) + 1
        if status == 200:
            tally.latencies.setdefault(spec.kind, []).append(time.monotonic() - t)
            tally.bits.setdefault(i, set()).add(bits)


async def _watch_rss(pid: int | None, tally: Tally, stop_event: asyncio.Event) -> None:
    while pid is not None and not stop_event.is_set():
        tally.rss.append(rss_mb(pid))
        await asyncio.sleep(0.5)


async def load(url: str, pid: int | None, specs: list[Spec], n: int, warmup: int,
               concurrency: int, disconnect: float, seed: int) -> tuple[Tally, float | None]:
    rng = random.Random(seed + 1)
    warm = [rng.randrange(len(specs)) for _ in range(warmup)]
    rest = [rng.randrange(len(specs)) for _ in range(n)]
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await _run(http, url, specs, warm, Tally(), rng, concurrency, disconnect)
        idle_kv_blocks(url)
        warm_rss = rss_mb(pid) if pid is not None else None
        tally = Tally()
        stop_event = asyncio.Event()
        watcher = asyncio.create_task(_watch_rss(pid, tally, stop_event))
        await _run(http, url, specs, rest, tally, rng, concurrency, disconnect)
        stop_event.set()
        await watcher
    return tally, warm_rss


async def _run(http, url, specs, order, tally, rng, concurrency, disconnect) -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in order:
        queue.put_nowait(i)
    await asyncio.gather(*(_client(http, url, specs, queue, tally, rng, disconnect)
                           for _ in range(concurrency)))


async def solo_mismatches(url: str, specs: list[Spec], tally: Tally) -> int:
    """Each completed spec sent alone: how many completed requests' bits differ from it."""
    bad = 0
    async with httpx.AsyncClient(timeout=600) as http:
        for i, seen in sorted(tally.bits.items()):
            status, alone = await send(http, url, specs[i])
            bad += len(seen - {alone}) if status == 200 else len(seen)
    return bad


def idle_kv_blocks(url: str, timeout: float = 60.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        used = metric(url, "samebits_kv_blocks_in_use")
        if used == 0 and metric(url, "samebits_num_requests_running") == 0:
            return 0.0
        time.sleep(0.5)
    return metric(url, "samebits_kv_blocks_in_use")


def _quantile(values: list[float], q: float) -> float | None:
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1]


def report(tally: Tally, warm_rss: float | None, end_rss: float | None, kv: float,
           mismatches: int, n: int) -> bool:
    five = four = 0
    for kind in sorted(set(tally.status) | set(tally.disconnected)):
        counts, lat = tally.status.get(kind, {}), tally.latencies.get(kind, [])
        k5 = sum(v for s, v in counts.items() if s >= 500)
        k4 = sum(v for s, v in counts.items() if 400 <= s < 500)
        five, four = five + k5, four + k4
        print(json.dumps({"kind": kind, "completed": len(lat), "5xx": k5, "4xx": k4,
                          "disconnected": tally.disconnected.get(kind, 0),
                          "p50_s": _quantile(lat, 0.5), "p99_s": _quantile(lat, 0.99)}))
    drift = None if warm_rss is None or end_rss is None else end_rss - warm_rss
    ok = five == 0 and four == 0 and kv == 0 and mismatches == 0 and (
        drift is None or drift <= RSS_FLAT_MB)
    print(json.dumps({"requests": n, "5xx": five, "4xx": four, "kv_blocks_in_use_idle": kv,
                      "rss_warm_mb": warm_rss, "rss_end_mb": end_rss, "rss_drift_mb": drift,
                      "rss_max_during_mb": max(tally.rss, default=None),
                      "solo_mismatches": mismatches, "ok": ok}), flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--warmup", type=int, help="requests before the N (default: 2 x concurrency)")
    ap.add_argument("--disconnect", type=float, default=0.1, help="share of clients that leave")
    ap.add_argument("--distinct", type=int, default=100, help="distinct request specs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--url", help="a running server with an embedding model (default: start one)")
    ap.add_argument("--pid", type=int, help="its process id, to watch its memory")
    args = ap.parse_args()
    proc, url, pid = None, args.url, args.pid
    if url is None:
        proc, url = start("--embed-model", "DEFAULT", "--max-model-len", "1024")
        pid = proc.pid
    try:
        specs = make_specs(args.distinct, args.seed)
        warmup = 2 * args.concurrency if args.warmup is None else args.warmup
        tally, warm_rss = asyncio.run(load(url, pid, specs, args.n, warmup, args.concurrency,
                                           args.disconnect, args.seed))
        kv = idle_kv_blocks(url)
        end_rss = rss_mb(pid) if pid is not None else None
        mismatches = asyncio.run(solo_mismatches(url, specs, tally))
        return 0 if report(tally, warm_rss, end_rss, kv, mismatches, args.n) else 1
    finally:
        if proc is not None:
            stop(proc)


if __name__ == "__main__":
    raise SystemExit(main())
