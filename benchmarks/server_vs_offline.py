"""What ``samebits serve`` delivers against the same engine offline (``LLM.generate``), same run.

    PYTHONPATH=$PWD python benchmarks/server_vs_offline.py                  # CPU: default model
    PYTHONPATH=$PWD python benchmarks/server_vs_offline.py --device cuda \\
        --model benchmarks/configs/qwen3-0.6b.json --load-format dummy      # GPU: 128 x 512/256 @ 64

The load: ``--requests`` prompts of ``--prompt-len`` random token ids, greedy, ``ignore_eos``,
``--max-tokens`` new tokens each. Offline, ``LLM.generate`` runs them all in one call; served, a
``samebits serve`` subprocess with the same engine options gets them from ``--concurrency``
closed-loop httpx clients (``/v1/completions``, token-id prompts; spread over
``--client-processes``), non-streamed and streamed (SSE, one chunk per token). Both engines run
at most ``--concurrency`` sequences per step (``max_num_seqs``) with the same KV cache and no
prefix caching, so they run the same batches; rounds alternate the three runs and each figure is
the best round (a busy host only slows a run down). Every served output's
``X-Samebits-Output-Hash`` (or the stream's ``output_hash``) must equal the offline one.

Time to first token: one request at a time (``--ttft-requests`` fresh prompts), offline
``LLM.generate`` with ``max_tokens=1`` against the first SSE chunk of a streamed request of 16
tokens (the engine goes on stepping while the chunk is sent); the median per round, the best
round.

Where the time goes: each run's line also gives the engine steps it took and the CPU seconds
spent (offline: this process; served: the server's processes, the event loop's and the engine's
apart, from /proc), so a served run that loses time shows whether it took more steps (a different
schedule) or more CPU (overhead), and on which side.

JSON lines: one per (mode, run) with tok/s, then per mode the ratios served / offline and the TTFT
difference, each with its target and whether it is met. ``--modes`` picks invariant and/or
standard (``--standard`` on the server, ``batch_invariant=False`` offline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import httpx

from samebits import LLM, SamplingParams
from samebits.server.output_hash import HEADER, output_hash

TARGETS = {"cpu": 0.95, "cuda": 0.9}  # served / offline tok/s, non-streamed and streamed
TTFT_TARGET_MS = 5.0  # served TTFT - offline TTFT at concurrency 1


@dataclass(frozen=True)
class Load:
    prompts: list[list[int]]
    max_tokens: int
    concurrency: int


# ---- offline ---------------------------------------------------------------------------------
def offline_run(llm: LLM, load: Load) -> tuple[float, list[str], dict]:
    """(generated tok/s, output hash per request, diagnostics) of one ``LLM.generate`` call."""
    params = SamplingParams(max_tokens=load.max_tokens, temperature=0.0, ignore_eos=True)
    steps, step = [0], llm.engine.step

    def counted():
        progressed = step()
        steps[0] += bool(progressed)
        return progressed
    llm.engine.step = counted
    cpu, t0 = _cpu_s(), time.perf_counter()
    try:
        outs = llm.generate(load.prompts, params, use_tqdm=False)
    finally:
        del llm.engine.step
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    diag = {"steps": steps[0], "cpu_s": round(_cpu_s() - cpu, 2)}
    return tokens / wall, [_hash(o.outputs[0]) for o in outs], diag


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _hash(out) -> str:
    return output_hash([(out.token_ids, out.token_logprobs)])


def offline_ttft_ms(llm: LLM, prompts: list[list[int]]) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for p in prompts:
        t0 = time.perf_counter()
        llm.generate([p], params, use_tqdm=False)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ---- served ----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(engine_args: list[str]) -> tuple[subprocess.Popen, str, str]:
    port = _free_port()
    args = [sys.executable, "-m", "samebits", "serve", "--host", "127.0.0.1", "--port",
            str(port), "--log-level", "warning", "--canary-rate", "0", *engine_args]
    log = tempfile.NamedTemporaryFile("w", prefix="samebits-svo-", suffix=".log", delete=False)
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"samebits serve exited; see {log.name}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                model = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
                return proc, url, model
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"samebits serve not ready after 900 s; see {log.name}")


def _body(model: str, prompt: list[int], max_tokens: int, stream: bool) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _post(http: httpx.AsyncClient, body: dict) -> tuple[int, str, float]:
    """(completion tokens, output hash, seconds to the first token) of one request."""
    t0 = time.perf_counter()
    if not body["stream"]:
        r = await http.post("/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"], r.headers[HEADER], time.perf_counter() - t0
    first, tokens, digest = None, 0, ""
    async with http.stream("POST", "/v1/completions", json=body) as r:
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


async def _served(url: str, model: str, items: list[tuple[int, list[int]]], max_tokens: int,
                  concurrency: int, stream: bool, start_at: float
                  ) -> tuple[int, dict[int, str], list[float], float]:
    """``concurrency`` closed-loop clients over ``items`` (index, prompt) from ``start_at``
    (time.monotonic): (tokens, output hash by index, seconds to each first token, end time)."""
    todo, hashes, firsts, total = list(items), {}, [], 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal total
        while todo:
            i, prompt = todo.pop(0)
            n, hashes[i], first = await _post(http, _body(model, prompt, max_tokens, stream))
            total += n
            firsts.append(first)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return total, hashes, firsts, time.monotonic()


def _clients(*args) -> tuple[int, dict[int, str], list[float], float]:
    return asyncio.run(_served(*args))


_POOL: list[ProcessPoolExecutor] = []  # client processes, started once


def _run_clients(url: str, model: str, load: Load, stream: bool, processes: int
                 ) -> tuple[float, list[str], list[float]]:
    """(tok/s, output hash per prompt, seconds to each first token) of the load sent by
    ``processes`` client processes (one: this process), each a share of the prompts and of the
    concurrency, all starting at once."""
    items = list(enumerate(load.prompts))
    shares = [(items[k::processes], load.concurrency // processes
               + (k < load.concurrency % processes)) for k in range(processes)]
    shares = [(s, c) for s, c in shares if s and c]
    start_at = time.monotonic() + (0.3 if len(shares) > 1 else 0.0)
    args = [(url, model, s, load.max_tokens, c, stream, start_at) for s, c in shares]
    if len(args) == 1:
        results = [_clients(*args[0])]
    else:
        if not _POOL:
            _POOL.append(ProcessPoolExecutor(processes, mp.get_context("spawn")))
        results = list(_POOL[0].map(_clients, *zip(*args, strict=True)))
    hashes: dict[int, str] = {}
    for r in results:
        hashes.update(r[1])
    wall = max(r[3] for r in results) - start_at
    return (sum(r[0] for r in results) / wall, [hashes[i] for i in range(len(items))],
            [f for r in results for f in r[2]])


def served_run(url: str, model: str, load: Load, stream: bool, pid: int | None = None,
               processes: int = 1) -> tuple[float, list[str], dict]:
    """(generated tok/s, output hash per request, diagnostics) of one served run; ``pid``: the
    server's, for its engine steps and CPU seconds."""
    before = _server_state(url, pid)
    rate, hashes, _ = _run_clients(url, model, load, stream, processes)
    after = _server_state(url, pid)
    diag = {k: round(after[k] - before[k], 2) for k in before}
    return rate, hashes, diag


def served_ttft_ms(url: str, model: str, prompts: list[list[int]]) -> float:
    _, _, firsts = _run_clients(url, model, Load(prompts, 16, 1), True, 1)
    return statistics.median(firsts) * 1e3


def _server_state(url: str, pid: int | None) -> dict[str, float]:
    """Engine steps so far (the batch-size histogram's count) and CPU seconds per thread kind."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    steps = next(float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("samebits_batch_size_count"))
    return {"steps": steps, **(_thread_cpu_s(pid) if pid is not None else {})}


def _thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of the server's event loop (its main thread), the rest of the server process,
    and the engine process (its children), from /proc (Linux; empty elsewhere)."""
    out = {"loop_cpu_s": 0.0, "api_other_cpu_s": 0.0, "engine_cpu_s": 0.0}
    try:
        children = open(f"/proc/{pid}/task/{pid}/children").read().split()
        for p, key in [(pid, None), *((int(c), "engine_cpu_s") for c in children)]:
            for tid in os.listdir(f"/proc/{p}/task"):
                fields = open(f"/proc/{p}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
                k = key or ("loop_cpu_s" if int(tid) == pid else "api_other_cpu_s")
                out[k] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return {}
    return out


# ---- the comparison --------------------------------------------------------------------------
def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(vocab, 40000)
    return [[rng.randrange(100, hi) for _ in range(length)] for _ in range(n)]


def engine_options(args: argparse.Namespace, kv_blocks: int) -> dict:
    """The engine both sides run: ``--concurrency`` sequences per step, the same KV cache, no
    prefix caching (the three runs of a round send the same prompts; none may find them cached)."""
    return dict(model=args.model, load_format=args.load_format, device=args.device,
                max_num_seqs=args.concurrency, num_kv_blocks=kv_blocks,
                max_model_len=args.prompt_len + args.max_tokens + 16,
                enable_prefix_caching=False)


def server_args(opts: dict, standard: bool, extra: Sequence[str] = ()) -> list[str]:
    out = ["--device", opts["device"], "--load-format", opts["load_format"],
           "--max-num-seqs", str(opts["max_num_seqs"]), "--num-kv-blocks",
           str(opts["num_kv_blocks"]), "--max-model-len", str(opts["max_model_len"]),
           "--no-prefix-caching"]
    if opts["model"] is not None:
        out += ["--model", opts["model"]]
    return out + (["--standard"] if standard else []) + list(extra)


def run_mode(args: argparse.Namespace, mode: str) -> None:
    blocks = args.concurrency * math.ceil((args.prompt_len + args.max_tokens + 16) / 16) + 64
    opts = engine_options(args, blocks)
    llm = LLM(**opts, batch_invariant=mode == "invariant")
    vocab = llm.engine.loaded.model_config.vocab_size
    proc, url, model = start_server(server_args(opts, mode == "standard", args.serve_args))
    try:
        _compare(args, mode, llm, url, model, vocab, proc.pid)
    finally:
        proc.terminate()
        proc.wait(60)
        del llm


def _compare(args, mode: str, llm: LLM, url: str, model: str, vocab: int, pid: int) -> None:
    warm = Load(_prompts(args.concurrency, args.prompt_len, vocab, 1), 8, args.concurrency)
    offline_run(llm, warm)
    served_run(url, model, warm, False, processes=args.client_processes)  # starts the clients
    served_run(url, model, warm, True, processes=args.client_processes)
    best = {"offline": 0.0, "served": 0.0, "served_stream": 0.0}
    ttft = {"offline": math.inf, "served": math.inf}
    for r in range(args.rounds):
        load = Load(_prompts(args.requests, args.prompt_len, vocab, 100 + r), args.max_tokens,
                    args.concurrency)
        rate, expected, diag = offline_run(llm, load)
        best["offline"] = max(best["offline"], rate)
        _emit(mode=mode, run="offline", round=r, tok_s=round(rate, 1), **diag)
        for key, stream in (("served", False), ("served_stream", True)):
            rate, got, diag = served_run(url, model, load, stream, pid, args.client_processes)
            best[key] = max(best[key], rate)
            _emit(mode=mode, run=key, round=r, tok_s=round(rate, 1),
                  bits_equal_offline=got == expected, **diag)
        ttft_prompts = _prompts(args.ttft_requests, args.prompt_len, vocab, 10_000 + r)
        ttft["offline"] = min(ttft["offline"], offline_ttft_ms(llm, ttft_prompts))
        ttft_prompts = _prompts(args.ttft_requests, args.prompt_len, vocab, 20_000 + r)
        ttft["served"] = min(ttft["served"], served_ttft_ms(url, model, ttft_prompts))
    _report(args, mode, best, ttft)


def _report(args, mode: str, best: dict, ttft: dict) -> None:
    target = TARGETS["cuda" if args.device.startswith("cuda") else "cpu"]
    for key in ("served", "served_stream"):
        ratio = best[key] / best["offline"]
        _emit(mode=mode, figure=f"{key}_over_offline", offline_tok_s=round(best["offline"], 1),
              served_tok_s=round(best[key], 1), ratio=round(ratio, 3), target=target,
              met=ratio >= target)
    diff = ttft["served"] - ttft["offline"]
    _emit(mode=mode, figure="ttft_served_minus_offline_ms", offline_ms=round(ttft["offline"], 2),
          served_ms=round(ttft["served"], 2), diff_ms=round(diff, 2), target_ms=TTFT_TARGET_MS,
          met=diff <= TTFT_TARGET_MS)


def _emit(**row) -> None:
    print(json.dumps({"bench": "server_vs_offline", **row}), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default=None, help="None: the default model; a config.json needs "
                   "--load-format dummy")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--requests", type=int, default=None, help="default: 32 (CPU), 128 (CUDA)")
    p.add_argument("--prompt-len", type=int, default=None, help="default: 128 (CPU), 512 (CUDA)")
    p.add_argument("--max-tokens", type=int, default=None, help="default: 64 (CPU), 256 (CUDA)")
    p.add_argument("--concurrency", type=int, default=None, help="default: 8 (CPU), 64 (CUDA)")
    p.add_argument("--ttft-requests", type=int, default=8)
    p.add_argument("--client-processes", type=int, default=None,
                   help="processes the clients are spread over, so that parsing the responses "
                   "never limits what is measured; default: 1 (CPU), 4 (CUDA)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=["invariant", "standard"],
                   choices=["invariant", "standard"])
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                   help="more options for samebits serve (last on the line), e.g. "
                   "--no-engine-process")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    for name, cpu, gpu in (("requests", 32, 128), ("prompt_len", 128, 512),
                           ("max_tokens", 64, 256), ("concurrency", 8, 64),
                           ("client_processes", 1, 4)):
        if getattr(args, name) is None:
            setattr(args, name, gpu if cuda else cpu)
    _emit(config={k: v for k, v in vars(args).items()})
    try:
        for mode in args.modes:
            run_mode(args, mode)
    finally:
        for pool in _POOL:
            pool.shutdown()


if __name__ == "__main__":
    main()
