"""Tensor parallel, phase by phase, within a wall budget: where a TP 2 engine's start, first step,
decode or shutdown stalls, and whether its greedy tokens equal TP 1's. JSON lines, flushed.

    python benchmarks/tp_smoke.py --out "$OUT" 2> "$OUT/stderr.txt"      # 2 GPUs (NCCL)
    python benchmarks/tp_smoke.py --device cpu                            # the same on gloo

A line per phase, each with ``t`` (seconds since start):
- ``env``: torch, NCCL, the GPUs, the NCCL variables in force (NCCL_DEBUG defaults to WARN).
- ``group``: two spawned processes join a ``TPGroup`` alone (tcp rendezvous, its connect check:
  an all_gather on the device and a gloo reduction), broadcast an object and a device tensor, then
  leave as an engine's ranks do (rank 1 exits, rank 0 releases its side alone): the transport
  without the engine.
- ``spawned``, ``loaded``, ``connected``, ``kv_budget``, ``graphs``: the TP 2 engine's start, read
  from its log records (``kv_budget`` and ``graphs`` on CUDA only); ``ready``: ``LLM(...)`` returned
  (its warm-up done), with each rank's KV blocks and graphs.
- ``memory``: each rank's weight bytes and ``torch.cuda.memory_allocated`` of its device (every
  rank's, gathered), and the memory in use on each GPU as the driver sees it (every process's).
- ``first_step`` (one token: a prefill and its sampling), ``tokens`` (8 greedy tokens of 2 prompts:
  CUDA-graph decode steps and steps launched ahead), ``closed`` (shutdown: seconds, rank 1's exit
  code -- 0: it exited by itself when told to stop, -9: it was killed --, and whether
  torch.distributed still has a process group: false once rank 0 released its side).
- ``trace``: the collectives each rank issued (``SAMEBITS_TP_TRACE``), their counts and the first
  index where the ranks' sequences differ (null: none).
- ``second_engine``: a second TP 2 engine built in the same process after the first shut down
  (the process group formed anew), its 8 greedy tokens and whether they equal the first
  engine's; ``second_closed`` as ``closed``.
- ``tp1`` and ``tp1_segmented``, then ``bits``: TP 2 against one device -- the default engine, and
  the engine with its row-parallel layers on the gathered segmented path (TP 2's arithmetic on one
  device; the tensors are compared with ``==`` on token ids and logprobs). One device runs TP 2's
  K chains by default (``OpBackend.row_parallel_chains``), so both are expected true. ``bits``
  also gives each rank's
  weight bytes as a fraction of the one-device engine's (about 0.5: each rank holds its shard).

Watchdog: every process dumps its threads' stacks to stderr every ``--dump-every`` seconds (rank
1 through ``SAMEBITS_FAULTHANDLER_S``); at ``--budget`` seconds the script prints a ``watchdog``
line (the last phase, each rank's last collective), dumps the stacks, kills the ranks and exits 3;
faulthandler's own timer exits 1 a few seconds later should the interpreter be stuck.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import gc
import json
import logging
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

CONFIG = Path(__file__).parent / "configs" / "qwen3-tiny.json"
PROMPTS = [[3] * 5, [(7 * j) % 8000 + 1 for j in range(40)]]
START = time.monotonic()
LAST = {"phase": "start"}
OUT: Path | None = None
# engine log records that mark a phase of the TP 2 start (rank 0's process)
LOG_PHASES = {"tensor parallel: spawned": "spawned", "tensor parallel: 2 ranks loaded": "loaded",
              "tensor parallel: process group connected": "connected",
              "KV cache budget on": "kv_budget", "captured ": "graphs"}


def emit(phase: str, **fields) -> None:
    LAST["phase"] = phase
    line = json.dumps({"phase": phase, "t": round(time.monotonic() - START, 1), **fields})
    print(line, flush=True)
    if OUT is not None:
        with open(OUT / "tp_smoke.jsonl", "a", encoding="utf-8") as f:
            f.write(line + "\n")


class PhaseLog(logging.Handler):
    """The engine's log records that mark a start phase, as phase lines."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for prefix, phase in LOG_PHASES.items():
            if message.startswith(prefix):
                emit(phase, log=message)


def arm_watchdog(budget: float, dump_every: float, trace_dirs: list[Path]) -> None:
    faulthandler.enable()
    faulthandler.dump_traceback_later(budget + 5, exit=True)  # needs no interpreter

    def periodic() -> None:
        while True:
            time.sleep(dump_every)
            print(f"--- rank 0 stacks at {time.monotonic() - START:.0f} s ---", file=sys.stderr,
                  flush=True)
            faulthandler.dump_traceback(all_threads=True)

    def deadline() -> None:
        time.sleep(budget)
        emit("watchdog", budget_s=budget, last_phase=LAST["phase"],
             last_collectives={str(d.name): _trace_tails(d) for d in trace_dirs})
        faulthandler.dump_traceback(all_threads=True)
        for child in mp.active_children():
            child.kill()
        os._exit(3)

    threading.Thread(target=periodic, daemon=True).start()
    threading.Thread(target=deadline, daemon=True).start()


def _read_trace(directory: Path, rank: int) -> list[dict]:
    path = directory / f"rank-{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _trace_tails(directory: Path) -> dict:
    return {f"rank_{r}": {"count": len(t), "last": t[-2:]}
            for r in (0, 1) for t in [_read_trace(directory, r)]}


def trace_summary(directory: Path) -> dict:
    a, b = _read_trace(directory, 0), _read_trace(directory, 1)
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    ops: dict[str, int] = {}
    for entry in a:
        ops[entry["op"]] = ops.get(entry["op"], 0) + 1
    return {"counts": [len(a), len(b)], "first_difference": first,
            "at_difference": None if first is None else [a[first:first + 1], b[first:first + 1]],
            "rank_0_ops": ops}


def _group_rank(rank: int, device_type: str, init_method: str, queue) -> None:
    """One of the two processes of the ``group`` phase."""
    import torch

    from samebits.distributed.group import TPGroup
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    group = TPGroup(rank, 2, device)
    group.connect(init_method)
    message = group.broadcast_object(("hello", (rank,)))
    x = group.broadcast_tensor(torch.full((4,), 7 if rank == 0 else 0, device=device)).tolist()
    group.min_int(0)  # every rank's device work is done before rank 0 releases its side
    left = group.leave() if rank == 0 else True  # rank 1 leaves by exiting, as an engine's do
    queue.put((rank, message[0], x, left))
    queue.close()
    queue.join_thread()
    if rank:
        os._exit(0)


def group_phase(device_type: str, timeout: float) -> None:
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    queue = ctx.Queue()
    procs = [ctx.Process(target=_group_rank, args=(r, device_type, init, queue), daemon=True)
             for r in (0, 1)]
    for p in procs:
        p.start()
    results, deadline = [], time.monotonic() + timeout
    while len(results) < 2 and time.monotonic() < deadline:
        try:
            results.append(queue.get(timeout=1))
        except Exception:  # noqa: BLE001 -- queue.Empty: poll again until the deadline
            if not any(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(max(5.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    emit("group", ok=len(results) == 2 and all(r[1:] == ("hello", [7] * 4, True)
                                                for r in results),
         results=sorted(results), exitcodes=[p.exitcode for p in procs])


def generate(llm, max_tokens: int) -> list[tuple[list[int], list[float]]]:
    from samebits import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].token_logprobs) for o in outs]


def tp2_phases(options: dict) -> tuple[list, list[int]]:
    """The TP 2 engine's phases; (its outputs, each rank's weight bytes)."""
    from samebits import LLM
    llm = LLM(str(CONFIG), tensor_parallel_size=2, **options)
    runner = llm.engine.runner
    weights = runner.weight_bytes()
    emit("ready", kv_blocks=runner.num_blocks,
         graphs=0 if runner.graphs is None else len(runner.graphs.graphs))
    emit("memory", weight_bytes_per_rank=weights,
         memory_allocated_per_rank=runner.memory_allocated(), device_used_bytes=_device_used())
    emit("first_step", tokens=generate(llm, 1))
    out = generate(llm, 8)
    emit("tokens", tokens=[ids for ids, _ in out])
    shut_down(llm, "closed")
    return out, weights


def second_engine(options: dict, first: list) -> None:
    """A second TP 2 engine in this process, after the first shut down: a new process group."""
    from samebits import LLM
    llm = LLM(str(CONFIG), tensor_parallel_size=2, **options)
    again = generate(llm, 8)
    emit("second_engine", tokens=[ids for ids, _ in again], same_as_first=again == first)
    shut_down(llm, "second_closed")


def shut_down(llm, phase: str) -> None:
    import torch.distributed as dist
    runner = llm.engine.runner
    rank_1 = runner.peers.procs[1]
    start = time.monotonic()
    runner.shutdown()
    emit(phase, seconds=round(time.monotonic() - start, 2), rank_1_exitcode=rank_1.exitcode,
         process_group_initialized=dist.is_initialized())


def _device_used() -> list[int]:
    """Bytes in use on each GPU, every process's (nvidia-smi's count); [] on the CPU."""
    import torch
    if not torch.cuda.is_available():
        return []
    try:  # NVML: no CUDA context on the other GPU
        return [torch.cuda.device_memory_used(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 -- no NVML bindings: the driver's count on each device
        return [t - f for f, t in (torch.cuda.mem_get_info(i)
                                   for i in range(torch.cuda.device_count()))]


def _free_memory() -> None:
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def tp1(options: dict, segmented: bool) -> tuple[list, list[int]]:
    from samebits import LLM
    from samebits.models.parallel import RowParallelLinear
    llm = LLM(str(CONFIG), **((options | {"enforce_eager": True}) if segmented else options))
    if segmented:  # TP 2's arithmetic on one device: every K segment's partial, tree-summed
        for m in llm.engine.runner.model.modules():
            if isinstance(m, RowParallelLinear):
                m.forward = functools.partial(RowParallelLinear.gathered, m)
    out = generate(llm, 8)
    emit("tp1_segmented" if segmented else "tp1", tokens=[ids for ids, _ in out])
    weights = llm.engine.runner.weight_bytes()
    del llm
    _free_memory()
    return out, weights


def environment(device_type: str) -> None:
    import torch
    fields = {"torch": torch.__version__, "device": device_type,
              "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}
    if device_type == "cuda":
        version = torch.cuda.nccl.version()
        fields |= {"nccl": ".".join(map(str, version)) if isinstance(version, tuple)
                   else str(version),
                   "gpus": [torch.cuda.get_device_name(i)
                            for i in range(torch.cuda.device_count())]}
    emit("env", **fields)


def _setup(args: argparse.Namespace) -> tuple[str, list[Path]]:
    """The device, the trace directories; environment, watchdog and log hooks in place."""
    global OUT
    import torch

    device = args.device or ("cuda" if torch.cuda.device_count() >= 2 else "cpu")
    OUT = args.out
    work = OUT or Path(os.environ.get("TMPDIR", "/tmp")) / f"tp_smoke_{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    traces = [work / "trace_group", work / "trace_tp2", work / "trace_tp2_second"]
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ["SAMEBITS_FAULTHANDLER_S"] = str(args.dump_every)
    arm_watchdog(args.budget, args.dump_every, traces)
    engine_log = logging.getLogger("samebits")
    engine_log.setLevel(logging.INFO)
    engine_log.addHandler(PhaseLog())
    engine_log.addHandler(logging.StreamHandler(sys.stderr))
    return device, traces


@contextlib.contextmanager
def reported() -> Iterator[None]:
    """An exception becomes an ``error`` line (the later phases still run)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 -- reported; the script goes on
        emit("error", during=LAST["phase"], error=f"{type(e).__name__}: {e}"[-3000:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--out", type=Path, default=None, help="also write the lines and traces here")
    p.add_argument("--budget", type=float, default=140.0, help="seconds before the watchdog")
    p.add_argument("--dump-every", type=float, default=30.0, help="seconds between stack dumps")
    args = p.parse_args()
    device, traces = _setup(args)
    environment(device)
    os.environ["SAMEBITS_TP_TRACE"] = str(traces[0])
    group_phase(device, timeout=min(60.0, args.budget / 3))
    os.environ["SAMEBITS_TP_TRACE"] = str(traces[1])
    options = dict(load_format="dummy", device=device, seed=0, max_num_seqs=4,
                   max_model_len=512, max_num_batched_tokens=512, enable_prefix_caching=False)
    if device == "cuda":  # TP 2 sizes its KV cache from the memory left (the profiling runs)
        options |= dict(dtype="bfloat16", gpu_memory_utilization=0.5)
    two, weights = None, None
    with reported():
        two, weights = tp2_phases(options)
    emit("trace", **trace_summary(traces[1]))
    if two is not None:
        os.environ["SAMEBITS_TP_TRACE"] = str(traces[2])
        _free_memory()  # the first engine's weights and KV cache
        with reported():
            second_engine(options, two)
    os.environ.pop("SAMEBITS_TP_TRACE")
    options.pop("gpu_memory_utilization", None)
    options["kv_cache_memory_bytes"] = 1 << 28
    (one, one_bytes), segmented = tp1(options, segmented=False), tp1(options, segmented=True)[0]
    emit("bits", equal_to_tp1=two == one, equal_to_tp1_segmented=two == segmented,
         tokens_equal_to_tp1=None if two is None else [a[0] == b[0] for a, b in
                                                        zip(two, one, strict=True)],
         weight_fraction_per_rank=None if weights is None else [round(b / one_bytes[0], 4)
                                                               for b in weights])
    os._exit(0)  # the watchdog threads and faulthandler's timer end with the process


if __name__ == "__main__":
    main()
