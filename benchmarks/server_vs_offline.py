"""What ``samebits serve`` delivers against the same engine offline (``LLM.generate``), same run.

    PYTHONPATH=$PWD python -u benchmarks/server_vs_offline.py                # CPU: default model
    PYTHONPATH=$PWD python -u benchmarks/server_vs_offline.py --threads 1 \
        --requests 16 --prompt-len 64 --max-tokens 32 --rounds 5           # CPU: a small shared host
    PYTHONPATH=$PWD python -u benchmarks/server_vs_offline.py --device cuda \\
        --model benchmarks/configs/qwen3-0.6b.json --load-format dummy \\
        --quick --out results.jsonl                                        # GPU: < 4 minutes

The load: ``--requests`` prompts of ``--prompt-len`` random token ids, greedy, ``ignore_eos``,
``--max-tokens`` new tokens each. Offline, ``LLM.generate`` runs them all in one call; served, a
``samebits serve`` subprocess with the same engine options gets them from ``--concurrency``
closed-loop httpx clients (``/v1/completions``, token-id prompts; spread over
``--client-processes``), non-streamed and streamed (SSE, one chunk per token). Both engines run
at most ``--concurrency`` sequences per step (``max_num_seqs``) with the same KV cache and no
prefix caching, so they run the same batches. Each round runs, per mode, offline, served and
served streamed back to back; each figure is the best round so far (a busy host only slows a run
down). Every served output's ``X-Samebits-Output-Hash`` (or the stream's ``output_hash``) is
compared with the offline one (``bits_equal_offline``).

Time to first token: one request at a time, ``--ttft-requests`` pairs alternating an offline
``LLM.generate`` of ``max_tokens=1`` with the first SSE chunk of a served streamed request of 16
tokens (fresh prompts each). The figure is the median over every pair so far of served minus
offline (each pair measured back to back, so a busy host's drift cancels), with both medians,
and ``outside_steps_diff_ms``: the median of what serving adds outside the engine step (served
TTFT less the request's time in the engine, from the hand-over (``RequestGroup.arrival``) to the
end of the step that made its first token, read from the server's TTFT histogram around each
request; less what ``LLM.generate`` spends outside its step): HTTP in, the hand-over and the
first chunk out, free of the step's own noise. Each round's line gives its medians.

Where the time goes: each run's line gives its wall time, the engine steps it took and the
milliseconds per step, and the CPU seconds spent (offline: this process; served, from /proc: the
API process's event loop and other threads, the engine process's main thread (the core's loop)
and other threads, and the clients), with ``loop_busy`` and ``engine_main_busy`` (CPU seconds
over the wall time: near 1, that thread is the bottleneck; the engine's well below 1, it waited
for requests). So a served run that loses time shows whether it took more steps (a different
schedule) or longer steps, and which process spent the CPU. ``--profile`` adds one more served
run of each kind under py-spy (benchmarks/spy_profile.py): where the event loop and the engine
core spent their samples.

Robust and diagnosable: every phase writes a JSON progress line to stderr at once (phase, seconds
elapsed and left of ``--budget-s``); every wait has a timeout that ends in a clear error (with the
server's stacks and log); each run's line and each figure go to stdout (and ``--out``) as soon as
measured, flushed, so a run cut short still returns what it measured. All servers and the offline
engines start at once; a round that would not fit in the budget left is skipped (and says so); a
watchdog ends a run that hangs past the budget with every thread's stack; SIGTERM (``timeout``)
diagnoses and stops too. The servers run in a process group of their own and are always stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from typing import Any, TextIO

import httpx
from bench_clock import BudgetSpent, Clock
from http_load import ClientPool, Share, first_token_s
from offline_runs import (
    Load,
    TTFTPair,
    offline_engine,
    offline_run,
    offline_ttft_s,
    run_diag,
)
from spy_profile import Spy
from watched_server import WatchedServer, is_engine_process

BENCH = "server_vs_offline"
TARGETS = {"cpu": 0.95, "cuda": 0.9}  # served / offline tok/s, non-streamed and streamed
TTFT_TARGET_MS = 5.0  # served TTFT - offline TTFT at concurrency 1
RUNS = ("offline", "served", "served_stream")
WARM_TTFT_PAIRS = 2


class Emitter:
    """Result lines: stdout and ``--out``, each flushed as it is written."""

    def __init__(self, path: str | None) -> None:
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.file: TextIO | None = open(path, "a") if path else None

    def __call__(self, **row: Any) -> None:
        line = json.dumps({"bench": BENCH, **row})
        print(line, flush=True)
        if self.file is not None:
            self.file.write(line + "\n")
            self.file.flush()


# ---- served ----------------------------------------------------------------------------------
def served_run(server: WatchedServer, pool: ClientPool, load: Load, stream: bool,
               args: argparse.Namespace, timeout: float) -> tuple[float, list[str], dict]:
    """(generated tok/s, output hash per request, diagnostics) of one served run: the load's
    prompts dealt over the client processes, each with its share of the concurrency."""
    from samebits.server.output_hash import HEADER

    items, n = list(enumerate(load.prompts)), pool.processes
    shares = [(items[k::n], load.concurrency // n + (k < load.concurrency % n)) for k in range(n)]
    shares = [(s, c) for s, c in shares if s and c]
    start_at = time.monotonic() + (0.3 if len(shares) > 1 else 0.0)
    jobs = [Share(server.url, server.model, s, load.max_tokens, c, stream, start_at, HEADER,
                  args.request_timeout_s) for s, c in shares]
    before = server.state()
    results = pool.run(jobs, timeout)
    after = server.state()
    wall = max(r.end for r in results) - start_at
    hashes = {i: h for r in results for i, h in r.hashes.items()}
    cpu = {k: after[k] - before[k] for k in before if k.endswith("_cpu_s")}
    diag = run_diag(wall, after["steps"] - before["steps"], **cpu,
                 client_cpu_s=sum(r.cpu_s for r in results))
    for key, busy in (("loop_cpu_s", "loop_busy"), ("engine_main_cpu_s", "engine_main_busy")):
        if key in cpu:  # the share of the wall time that thread was on a CPU
            diag[busy] = round(cpu[key] / wall, 3)
    return sum(r.tokens for r in results) / wall, [hashes[i] for i in range(len(items))], diag


# ---- the comparison --------------------------------------------------------------------------
def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(vocab, 40000)
    return [[rng.randrange(100, hi) for _ in range(length)] for _ in range(n)]


def engine_options(args: argparse.Namespace) -> dict:
    """The engine both sides run: ``--concurrency`` sequences per step, the same KV cache, no
    prefix caching (the three runs of a round send the same prompts; none may find them cached)."""
    max_len = args.prompt_len + args.max_tokens + 16
    blocks = args.concurrency * math.ceil(max_len / 16) + 64
    return dict(model=args.model, load_format=args.load_format, device=args.device,
                max_num_seqs=args.concurrency, num_kv_blocks=blocks, max_model_len=max_len,
                enable_prefix_caching=False)


def server_args(opts: dict, mode: str, extra: list[str]) -> list[str]:
    out = ["--canary-rate", "0", "--device", opts["device"], "--load-format", opts["load_format"],
           "--max-num-seqs", str(opts["max_num_seqs"]), "--num-kv-blocks",
           str(opts["num_kv_blocks"]), "--max-model-len", str(opts["max_model_len"]),
           "--no-prefix-caching"]
    if opts["model"] is not None:
        out += ["--model", opts["model"]]
    return out + (["--standard"] if mode == "standard" else []) + extra


class Bench:
    """Every mode's server and offline engine, the client processes, the best figures."""

    def __init__(self, args: argparse.Namespace, clock: Clock, emit: Emitter) -> None:
        self.args, self.clock, self.emit = args, clock, emit
        self.servers: dict[str, WatchedServer] = {}
        self.llms: dict[str, Any] = {}
        self.pool: ClientPool | None = None
        self.vocab = 0
        self.dropped: set[str] = set()  # modes that failed to start
        self.best = {m: dict.fromkeys(RUNS, 0.0) for m in args.modes}
        self.ttft: dict[str, list[TTFTPair]] = {m: [] for m in args.modes}  # over the rounds

    def start(self) -> None:
        """Every server, the client processes and every offline engine, all at once. A mode
        whose server or offline engine fails to start is dropped (an ``error`` line, the
        server's stacks and log on stderr); the others go on."""
        a, opts = self.args, engine_options(self.args)
        env = {"OMP_NUM_THREADS": str(a.threads)} if a.threads else {}
        for mode in a.modes:
            self.servers[mode] = WatchedServer(server_args(opts, mode, a.serve_args), mode, env)
            self.clock.phase("server_starting", mode=mode, pid=self.servers[mode].proc.pid,
                             log=self.servers[mode].log.name)
        self.pool = ClientPool(a.client_processes)
        for mode in a.modes:
            t0 = time.monotonic()
            with self._dropped_on_failure(mode, "offline engine"):
                self.llms[mode] = offline_engine(opts, mode == "invariant", a.threads)
                self.clock.phase("offline_engine_ready", mode=mode,
                                 s=round(time.monotonic() - t0, 1))
        self.pool.wait_ready(self.clock.timeout(a.start_timeout_s, "the client processes"))
        self.clock.phase("clients_ready", processes=a.client_processes)
        for mode in self.modes:
            with self._dropped_on_failure(mode, "server"):
                self.servers[mode].wait_ready(self.clock.timeout(a.start_timeout_s,
                                                                 f"the {mode} server start"))
                self.clock.phase("server_ready", mode=mode, pids=self.servers[mode].pids())
        if not self.modes:
            raise RuntimeError("no mode's server and offline engine started")
        self.vocab = self.llms[self.modes[0]].engine.loaded.model_config.vocab_size

    @property
    def modes(self) -> list[str]:
        """The modes still measured (``--modes``, less those that failed to start)."""
        return [m for m in self.args.modes if m not in self.dropped]

    @contextlib.contextmanager
    def _dropped_on_failure(self, mode: str, what: str) -> Iterator[None]:
        try:
            yield
        except (Exception, BudgetSpent) as e:
            self.dropped.add(mode)
            self.clock.phase("error", mode=mode, error=f"the {what} failed to start: "
                             f"{type(e).__name__}: {e}")
            self.emit(mode=mode, error=f"the {what} failed to start: {type(e).__name__}: {e}")
            traceback.print_exc()
            print(f"=== samebits serve ({mode}):\n{self.servers[mode].diagnose()}",
                  file=sys.stderr, flush=True)

    def warm(self, mode: str) -> None:
        """One small run of each kind and a TTFT pair: lazy kernels, connections, clients."""
        a = self.args
        load = Load(_prompts(a.concurrency, a.prompt_len, self.vocab, 1), 4, a.concurrency)
        offline_run(self.llms[mode], load)
        for stream in (False, True):
            served_run(self.servers[mode], self.pool, load, stream, a, self._run_timeout())
        self._ttft_pairs(mode, _prompts(WARM_TTFT_PAIRS, a.prompt_len, self.vocab, 2),
                         load.prompts[:WARM_TTFT_PAIRS])
        self.clock.phase("warm", mode=mode)

    def round(self, mode: str, r: int) -> None:
        a = self.args
        load = Load(_prompts(a.requests, a.prompt_len, self.vocab, 100 + r), a.max_tokens,
                    a.concurrency)
        self.clock.phase("run", mode=mode, round=r, run="offline")
        rate, expected, diag = offline_run(self.llms[mode], load)
        self._record(mode, "offline", r, rate, diag)
        for key, stream in (("served", False), ("served_stream", True)):
            self.clock.phase("run", mode=mode, round=r, run=key)
            rate, got, diag = served_run(self.servers[mode], self.pool, load, stream, a,
                                         self._run_timeout())
            self._record(mode, key, r, rate, diag, bits_equal_offline=got == expected)
        self.clock.phase("run", mode=mode, round=r, run="ttft")
        ttft = self._ttft_pairs(mode, _prompts(a.ttft_requests, a.prompt_len, self.vocab,
                                               10_000 + r),
                                _prompts(a.ttft_requests, a.prompt_len, self.vocab, 20_000 + r))
        self.emit(mode=mode, run="ttft", round=r, **{k: round(v * 1e3, 2) for k, v in ttft.items()})
        self.report(mode, r + 1)

    def _record(self, mode: str, run: str, r: int, rate: float, diag: dict, **more) -> None:
        self.best[mode][run] = max(self.best[mode][run], rate)
        self.emit(mode=mode, run=run, round=r, tok_s=round(rate, 1), **more, **diag)

    def _ttft_pairs(self, mode: str, offline_prompts: list[list[int]],
                    served_prompts: list[list[int]]) -> dict[str, float]:
        """Offline and served TTFT, measured alternately, each pair kept for the figure
        (``TTFTPair``); the round's medians (seconds)."""
        server, llm, pairs = self.servers[mode], self.llms[mode], []
        timeout = min(self.args.request_timeout_s, self.clock.timeout(600, "TTFT"))
        with httpx.Client(base_url=server.url, timeout=timeout, trust_env=False) as http:
            for p, q in zip(offline_prompts, served_prompts, strict=True):
                offline, in_steps = offline_ttft_s(llm, p)
                before = server.state()
                served = first_token_s(http, server.model, q, 16)
                after = server.state()
                pairs.append(TTFTPair(offline, in_steps, served,
                                      after["ttft_sum"] - before["ttft_sum"]))
        self.ttft[mode].extend(pairs)
        return {f"{k}_ms": statistics.median(getattr(x, k) for x in pairs)
                for k in ("offline", "offline_in_steps", "served", "served_in_engine")}

    def profile(self, mode: str) -> None:
        """One more served run of each kind with py-spy on the server's processes: a line each
        with where the API process's event loop and the engine process's core spent their time
        (benchmarks/spy_profile.py). Not counted in the figures."""
        a, server = self.args, self.servers[mode]
        engine = [p for p in server.pids()[1:] if is_engine_process(p)]
        pids = {"api": server.pids()[0], **({"engine": engine[0]} if engine else {})}
        load = Load(_prompts(a.requests, a.prompt_len, self.vocab, 30_000), a.max_tokens,
                    a.concurrency)
        for key, stream in (("served", False), ("served_stream", True)):
            self.clock.phase("profile", mode=mode, run=key)
            spy = Spy(pids, a.profile_dir, f"{mode}-{key}")
            try:
                rate, _, diag = served_run(server, self.pool, load, stream, a, self._run_timeout())
            finally:
                summary = spy.stop()
            for process, row in summary.items():
                self.emit(mode=mode, profile=key, process=process, tok_s=round(rate, 1),
                          ms_per_step=diag["ms_per_step"], **row)

    def _run_timeout(self) -> float:
        return self.clock.timeout(self.args.run_timeout_s, "a served run")

    def report(self, mode: str, rounds: int) -> None:
        """The mode's figures over the rounds so far (each line supersedes the previous)."""
        a, best = self.args, self.best[mode]
        target = TARGETS["cuda" if a.device.startswith("cuda") else "cpu"]
        for key in ("served", "served_stream"):
            ratio = best[key] / best["offline"]
            self.emit(mode=mode, figure=f"{key}_over_offline", rounds=rounds,
                      offline_tok_s=round(best["offline"], 1), served_tok_s=round(best[key], 1),
                      ratio=round(ratio, 3), target=target, met=ratio >= target)
        pairs = self.ttft[mode][WARM_TTFT_PAIRS:]
        diff_ms = statistics.median(x.served - x.offline for x in pairs) * 1e3
        self.emit(mode=mode, figure="ttft_served_minus_offline_ms", rounds=rounds,
                  pairs=len(pairs), diff_ms=round(diff_ms, 2), target_ms=TTFT_TARGET_MS,
                  met=diff_ms <= TTFT_TARGET_MS,
                  offline_ms=round(statistics.median(x.offline for x in pairs) * 1e3, 2),
                  served_ms=round(statistics.median(x.served for x in pairs) * 1e3, 2),
                  outside_steps_diff_ms=round(statistics.median(x.outside_diff for x in pairs)
                                              * 1e3, 2))

    def run(self) -> None:
        self.start()
        for mode in self.modes:
            self.warm(mode)
        last = 0.0  # seconds the previous round took
        for r in range(self.args.rounds):
            if r > 0 and self.clock.left() < 1.1 * last + self.args.stop_margin_s:
                self.clock.phase("skipped", rounds_left=self.args.rounds - r,
                                 why=f"a round takes ~{last:.0f} s; the budget has "
                                     f"{self.clock.left():.0f} s left")
                break
            t0 = time.monotonic()
            for mode in self.modes:
                self.round(mode, r)
            last = time.monotonic() - t0
            if r == 0 and self.args.profile:
                self._profile_if_it_fits(last)

    def _profile_if_it_fits(self, round_s: float) -> None:
        mode = self.modes[0]
        if not Spy.available():
            self.clock.phase("profile_skipped", why="py-spy is not on PATH")
        elif self.clock.left() < 0.5 * round_s + self.args.stop_margin_s:
            self.clock.phase("profile_skipped", why="the budget left is too short")
        else:
            self.profile(mode)

    def diagnose(self) -> None:
        for mode, server in self.servers.items():
            print(f"=== samebits serve ({mode}), pids {server.pids()}:\n{server.diagnose()}",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stop every server and client process (also from the watchdog's thread)."""
        if self.pool is not None:
            self.pool.close()
        for server in self.servers.values():
            server.terminate()  # all at once: each drains while the others do
        for mode, server in self.servers.items():
            server.stop()
            self.clock.phase("server_stopped", mode=mode, returncode=server.proc.returncode)

def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    p.add_argument("--ttft-requests", type=int, default=None, help="default: 8; --quick: 5")
    p.add_argument("--client-processes", type=int, default=None,
                   help="processes the clients are spread over, so that parsing the responses "
                   "never limits what is measured; default: 1 (CPU), 4 (CUDA)")
    p.add_argument("--rounds", type=int, default=None, help="default: 3; --quick: 2")
    p.add_argument("--modes", nargs="+", default=["invariant", "standard"],
                   choices=["invariant", "standard"])
    p.add_argument("--threads", type=int, default=None, help="torch threads of both engines "
                   "(OMP_NUM_THREADS for the server); default: torch's. On a small shared CPU, 1 "
                   "leaves the server's event loop and the clients a core of their own and keeps "
                   "the compute threads from waiting for each other")
    p.add_argument("--quick", action="store_true", help="fewer rounds and TTFT pairs, and a "
                   "budget of 220 s unless --budget-s says otherwise")
    p.add_argument("--budget-s", type=float, default=None, help="the whole run's seconds: waits "
                   "are capped by what is left, a round that would not fit is skipped, and a "
                   "watchdog ends a run still going 10 s past it (default: none; --quick: 220)")
    p.add_argument("--start-timeout-s", type=float, default=900.0,
                   help="seconds a server or the client processes may take to start")
    p.add_argument("--run-timeout-s", type=float, default=900.0, help="seconds a served run may take")
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--stop-margin-s", type=float, default=15.0,
                   help="seconds of the budget kept for stopping the servers")
    p.add_argument("--profile", action="store_true", help="after the first round, one more "
                   "served run of each kind under py-spy (when on PATH): where the event loop and "
                   "the engine core spent their time, a JSON line per process")
    p.add_argument("--profile-dir", default=None, help="py-spy's raw files (default: beside "
                   "--out, else a temporary directory)")
    p.add_argument("--out", default=None, help="also append the result lines to this file")
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
    for name, full, quick in (("rounds", 3, 2), ("ttft_requests", 8, 5)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.quick and args.budget_s is None:
        args.budget_s = 220.0
    if args.profile_dir is None:
        args.profile_dir = (os.path.dirname(os.path.abspath(args.out)) if args.out
                            else tempfile.mkdtemp(prefix="samebits-svo-"))
    return args


class Terminated(BaseException):
    """SIGTERM: the run is stopped from outside (``timeout``)."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated("SIGTERM: the run was stopped from outside")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    clock, emit = Clock(BENCH, args.budget_s), Emitter(args.out)
    emit(config=vars(args))
    bench = Bench(args, clock, emit)
    clock.watch(bench.close)
    signal.signal(signal.SIGTERM, _terminated)
    try:
        bench.run()
        return 0
    except (Exception, Terminated) as e:  # reported, diagnosed, and the run ends
        clock.phase("error", error=f"{type(e).__name__}: {e}")
        traceback.print_exc()
        if isinstance(e, Terminated | BudgetSpent):  # where every thread of this run was
            faulthandler.dump_traceback(all_threads=True)
        emit(error=f"{type(e).__name__}: {e}", elapsed_s=round(clock.elapsed(), 1))
        bench.diagnose()
        return 1
    finally:
        bench.close()
        clock.phase("done")


if __name__ == "__main__":
    sys.exit(main())
