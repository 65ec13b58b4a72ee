"""How long ``/health`` takes while the server handles maximal requests, and the memory after.

Starts ``samebits serve`` (the default model), polls ``/health`` every 50 ms and, per phase,
prints one JSON line with the polls' max and median latency and the server's RSS before and
after:

- ``idle``: nothing else running (the baseline of the same run);
- ``oversized``: bodies just under ``--max-request-bytes`` (16 MiB), refused by the cheap length
  bound before tokenization;
- ``tokenized``: prompts that pass the bound but not the context (tokenized off the event loop,
  then refused);
- ``prefill``: a prompt of the whole context (max_tokens 1), prefilled while the polls go on.

    PYTHONPATH=$PWD python benchmarks/health_latency.py
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time

import httpx

from tests.server.conftest import start_server

MAX_REQUEST_BYTES = 16 * 1024 * 1024


def _poll(url: str, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        t = time.monotonic()
        httpx.get(f"{url}/health", timeout=60).raise_for_status()
        out.append(time.monotonic() - t)
        time.sleep(0.05)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _phase(server, name: str, bodies: list[bytes], idle_s: float = 0.0) -> dict:
    rss_before = _rss_mb(server.proc.pid)
    stop, lat = threading.Event(), []
    poller = threading.Thread(target=_poll, args=(server.url, stop, lat))
    poller.start()
    codes = []
    try:
        time.sleep(idle_s)
        for body in bodies:
            r = httpx.post(f"{server.url}/v1/completions", content=body, timeout=3600,
                           headers={"Content-Type": "application/json"})
            codes.append(r.status_code)
    finally:
        stop.set()
        poller.join()
    return {"bench": "health_latency", "phase": name, "health_max_s": round(max(lat), 4),
            "health_p50_s": round(statistics.median(lat), 4), "polls": len(lat),
            "status_codes": sorted(set(codes)), "rss_before_mb": round(rss_before),
            "rss_after_mb": round(_rss_mb(server.proc.pid)), "target_s": 0.25,
            "machine": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--context-tokens", type=int, default=8000,
                   help="prompt tokens of the prefill phase (the default model's context: 8192)")
    args = p.parse_args()
    gen = start_server(max_model_len=None)
    server = next(gen)
    try:
        oversized = "hello world " * ((MAX_REQUEST_BYTES - 1000) // 12)
        tokenized = "hello world " * 6000
        whole = [100 + (i * 7919) % 40000 for i in range(args.context_tokens)]
        phases = {
            "idle": [],
            "oversized": [json.dumps({"prompt": oversized, "max_tokens": 1}).encode()] * 3,
            "tokenized": [json.dumps({"prompt": tokenized * 2, "max_tokens": 1}).encode()] * 3,
            "prefill": [json.dumps({"prompt": whole, "max_tokens": 1}).encode()],
        }
        for name, bodies in phases.items():
            print(json.dumps(_phase(server, name, bodies, idle_s=3.0 if not bodies else 0.0)),
                  flush=True)
    finally:
        gen.close()


if __name__ == "__main__":
    main()
