"""Closed-loop ``/v1/completions`` clients for the server benchmarks (token-id prompts, greedy,
``ignore_eos``), non-streamed or streamed (SSE), optionally spread over client processes so that
parsing the responses never limits what is measured.

Light on purpose: client processes are spawned, and a spawned process imports this module and the
script that started it, so neither may import torch or samebits at module level. Every request
has a timeout and every wait for a client process too; nothing here waits forever. httpx ignores
the proxy settings of the environment (the server is on the loopback).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import time
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class Share:
    """What one client process sends: ``items`` (index, prompt) over ``concurrency`` clients."""

    url: str
    model: str
    items: list[tuple[int, list[int]]]
    max_tokens: int
    concurrency: int
    stream: bool
    start_at: float  # time.monotonic() the clients start at (one clock for the machine)
    hash_header: str  # the response header of the output hash (non-streamed)
    timeout_s: float  # per request


@dataclass(frozen=True)
class ShareResult:
    tokens: int
    hashes: dict[int, str]
    firsts: list[float]  # seconds from sending to the first token, per request
    end: float  # time.monotonic() when the last response was read
    cpu_s: float  # this process's CPU seconds over the share


def body(model: str, prompt: list[int], max_tokens: int, stream: bool) -> dict:
    out = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
           "ignore_eos": True, "stream": stream}
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


async def _post(http: httpx.AsyncClient, share: Share, prompt: list[int]
                ) -> tuple[int, str, float]:
    """(completion tokens, output hash, seconds to the first token) of one request."""
    t0, request = time.perf_counter(), body(share.model, prompt, share.max_tokens, share.stream)
    if not share.stream:
        r = await http.post("/v1/completions", json=request)
        r.raise_for_status()
        return (r.json()["usage"]["completion_tokens"], r.headers[share.hash_header],
                time.perf_counter() - t0)
    first, tokens, digest = None, 0, ""
    async with http.stream("POST", "/v1/completions", json=request) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"]:
                first = time.perf_counter() - t0
            digest = chunk.get("output_hash") or digest
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens, digest, first


async def _closed_loop(share: Share) -> ShareResult:
    todo, hashes, firsts, total = list(share.items), {}, [], 0
    cpu = _cpu_s()

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal total
        while todo:
            i, prompt = todo.pop(0)
            n, hashes[i], first = await _post(http, share, prompt)
            total += n
            firsts.append(first)

    limits = httpx.Limits(max_connections=share.concurrency + 4)
    async with httpx.AsyncClient(base_url=share.url, timeout=share.timeout_s, limits=limits,
                                 trust_env=False) as http:
        await asyncio.sleep(max(0.0, share.start_at - time.monotonic()))
        await asyncio.gather(*(client(http) for _ in range(share.concurrency)))
    return ShareResult(total, hashes, firsts, time.monotonic(), _cpu_s() - cpu)


def run_share(share: Share) -> ShareResult:
    return asyncio.run(_closed_loop(share))


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _ready(_: int) -> int:
    time.sleep(0.2)  # long enough that each of the pool's processes takes one
    return os.getpid()


class ClientPool:
    """``processes`` spawned client processes (none for one: the shares run in this process)."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._pool = mp.get_context("spawn").Pool(processes) if processes > 1 else None

    def wait_ready(self, timeout: float) -> None:
        """Until every client process has started (imported its modules)."""
        if self._pool is not None:
            self._pool.map_async(_ready, range(self.processes), chunksize=1).get(timeout)

    def run(self, shares: list[Share], timeout: float) -> list[ShareResult]:
        """Every share's result; ``TimeoutError`` naming the wait after ``timeout`` s."""
        try:
            if self._pool is None or len(shares) == 1:
                return [asyncio.run(asyncio.wait_for(_closed_loop(s), timeout)) for s in shares]
            return self._pool.map_async(run_share, shares, chunksize=1).get(timeout)
        except (TimeoutError, mp.TimeoutError):
            raise TimeoutError(f"the clients' requests did not all finish in {timeout:.0f} s "
                               "(--run-timeout-s, or the budget left)") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()


def first_token_s(http: httpx.Client, model: str, prompt: list[int], max_tokens: int) -> float:
    """Seconds from sending a streamed request to its first token's chunk (the rest is read)."""
    t0, first = time.perf_counter(), None
    with http.stream("POST", "/v1/completions", json=body(model, prompt, max_tokens, True)) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"]:
                    first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first
