"""The latency of one row-parallel reduction between ranks, on NCCL and inside a CUDA graph, at the
shapes a step sends: JSON lines, each op's microseconds and its ratio to NCCL's all-reduce of the
same [T, H] fp32 sum (the stock op a standard-mode step issues).

    python benchmarks/collectives.py --world 2 --hidden 4096 --segments 8

Per T (tokens in the step): ``all_gather_partials`` (the invariant path: each rank's S/N fp32
partials gathered), ``all_reduce_fp32`` and ``all_reduce_bf16`` (one local sum), and, where torch
has it, symmetric memory's ``one_shot_all_reduce`` (peer loads, no NCCL). Each op is captured
``--reps`` times in one CUDA graph and replayed; the figure is the replay's time / reps.
"""

from __future__ import annotations

import argparse
import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp


def _graph_us(fn, reps: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[2]


def _ops(args, tokens: int, rank: int) -> dict:
    world, hidden, per = args.world, args.hidden, args.segments // args.world
    dev = torch.device("cuda", rank)
    parts = torch.randn(per, tokens, hidden, device=dev)
    gathered = torch.empty(world * per, tokens, hidden, device=dev)
    f32 = torch.randn(tokens, hidden, device=dev)
    bf16 = f32.to(torch.bfloat16)
    ops = {"all_gather_partials": lambda: dist.all_gather_into_tensor(gathered, parts),
           "all_reduce_fp32": lambda: dist.all_reduce(f32),
           "all_reduce_bf16": lambda: dist.all_reduce(bf16)}
    try:
        import torch.distributed._symmetric_memory as symm_mem
        group = dist.group.WORLD.group_name
        symm_mem.enable_symm_mem_for_group(group)
        buf = symm_mem.empty(tokens, hidden, dtype=torch.float32, device=dev)
        symm_mem.rendezvous(buf, group)
        buf.copy_(f32)
        torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group)
        ops["symm_one_shot_all_reduce_fp32"] = \
            lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group)
    except Exception as e:  # noqa: BLE001 -- reported, the NCCL figures stand alone
        if rank == 0:
            print(json.dumps({"tokens": tokens, "symm_mem": f"{type(e).__name__}: {e}"[:300]}),
                  flush=True)
    return ops


def _rank(rank: int, args, port: int) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.world, device_id=torch.device("cuda", rank))
    for tokens in args.tokens:
        us = {}
        for name, fn in _ops(args, tokens, rank).items():
            try:
                us[name] = _graph_us(fn, args.reps)
            except Exception as e:  # noqa: BLE001
                us[name] = None
                if rank == 0:
                    print(json.dumps({"tokens": tokens, "op": name,
                                      "error": f"{type(e).__name__}: {e}"[:300]}), flush=True)
        base = us["all_reduce_fp32"]
        if rank == 0:
            for name, t in us.items():
                if t is not None:
                    print(json.dumps({"world": args.world, "tokens": tokens,
                                      "hidden": args.hidden, "op": name, "us": round(t, 2),
                                      "ratio_to_nccl_all_reduce_fp32": round(t / base, 3)}),
                          flush=True)
    dist.barrier()
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--segments", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 8192])
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp.spawn(_rank, args=(args, port), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
