"""Where a tensor-parallel step spends its time on rank 0 (torch.profiler over the CUDA graphs'
kernels): JSON lines per workload -- wall seconds, the GPU's busy share of the wall, the
communication share of the GPU's time (NCCL kernels), the NCCL kernels' durations (p0: the
transfer alone; above it, a rank waiting for the other), and the top kernels; then, in a second
unprofiled run, rank 0's host seconds inside each part of a step (scheduling, announcing a call to
the other ranks, the forward or graph replay launch, sampling, postprocessing) against the wall:
where a step whose GPU idles waits on the host. Each profiled line also carries the GPU's busy
time as its kernels' union (``busy_union_s``: kernels that overlap under programmatic launch count
once) and its idle gaps by size and, with ``--host-ranges`` (host activity recorded too), by the
host part running when each began (``idle_by_host_s_count``: the forward's launches, a graph
replay, sampling, ...; ``outside`` between parts, or everything without the flag).

    python benchmarks/tp_profile.py --model benchmarks/configs/qwen3-8b.json --tp 2

``--push [LEVEL]``: every rank runs with ``SAMEBITS_TP_PUSH=LEVEL`` (1 when bare; unset, the engine's
default: 2 at two ranks, else 0; the row-parallel
sums pushed through symmetric memory, ``samebits.distributed.symmetric``); its barrier kernels and
peer copies count as communication too: the profiler names a level-1 peer copy "Memcpy DtoD", so
where the exchange copies (level 1, or 2 above two ranks) every device-to-device copy counts as
communication, and each line reports ``memcpy_dtod_s`` alone (level 0's is the steps' own
copies, which that count then includes too); at 2 with two ranks the GEMM's own stores into the
peer count as the GEMM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from functools import partial

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from samebits.distributed.symmetric import wanted
from samebits.tools.timeline import idle_report

WORKLOADS = {"decode-bs1": (1, 128, 64), "decode-bs64": (64, 128, 32), "prefill": (16, 1024, 1),
             "batch": (64, 1024, 256)}  # tensor_parallel.py's batch workload
# device work that counts as communication: NCCL's kernels; the push's barrier and peer copies
COMM = ("nccl", "barrier_kernel", "memcpy ptop")
DTOD = "memcpy dtod"  # how the profiler names a copy into a peer's mapped buffer


def comm_names(push: int, tp: int) -> tuple[str, ...]:
    """What counts as communication at push level ``push`` with ``tp`` ranks: ``COMM``, and
    device-to-device copies where the exchange copies (level 1, or 2 above two ranks)."""
    return COMM + (DTOD,) if push == 1 or (push == 2 and tp > 2) else COMM


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device_events(prof) -> list:
    """The profile's device work (kernels, copies), without the device-side spans of host
    annotations (``record_function`` ranges, e.g. ``host.*`` and ``nccl:*``)."""
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False) and not e.name.startswith(("host.", "nccl:"))]


def _summary(events: list, wall: float, top: int, comm_of: tuple[str, ...] = COMM) -> dict:
    """GPU seconds of ``events`` (``_device_events``; durations summed: overlapping kernels count
    twice), the share of them whose names contain one of ``comm_of``, the device-to-device
    copies' seconds, the NCCL kernels' duration percentiles, and the ``top`` kernels by time."""
    by_name: dict[str, list] = {}
    for e in events:
        entry = by_name.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.elapsed_us()
    total = sum(v[1] for v in by_name.values()) / 1e6
    comm = sum(v[1] for k, v in by_name.items() if any(c in k.lower() for c in comm_of)) / 1e6
    dtod = sum(v[1] for k, v in by_name.items() if DTOD in k.lower()) / 1e6
    nccl = sorted(e.time_range.elapsed_us() for e in events if "nccl" in e.name.lower())
    pct = {f"p{q}": round(nccl[min(len(nccl) - 1, len(nccl) * q // 100)], 1)
           for q in (0, 10, 50, 90, 99)} if nccl else {}
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"nccl_kernel_us": pct, "wall_s": round(wall, 4), "gpu_s": round(total, 4),
            "gpu_busy_share": round(total / wall, 3),
            "comm_share_of_gpu": round(comm / total, 3) if total else None,
            "memcpy_dtod_s": round(dtod, 4),
            "top": [(k[:70], v[0], round(v[1] / 1e3, 2)) for k, v in rows]}


ACTIVITY = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
HOST_PARTS = {"schedule": ("scheduler", "schedule"), "announce": ("runner.peers", "announce"),
              "forward": ("runner", "_forward"), "replay": ("runner.graphs", "run"),
              "sample": ("runner", "_sample"), "postprocess": ("", "postprocess")}


@contextlib.contextmanager
def _around_host_parts(engine, around: Callable[[str], contextlib.AbstractContextManager]
                       ) -> Iterator[None]:
    """While in it, each method of ``HOST_PARTS`` runs inside ``around(part)``."""
    restore = []
    for part, (path, name) in HOST_PARTS.items():
        owner = engine
        for attr in filter(None, path.split(".")):
            owner = getattr(owner, attr, None)
        if owner is None:
            continue
        inner = getattr(owner, name)

        def wrapped(*args, _inner=inner, _part=part, **kwargs):
            with around(_part):
                return _inner(*args, **kwargs)
        setattr(owner, name, wrapped)
        restore.append((owner, name))
    try:
        yield
    finally:
        for owner, name in restore:
            delattr(owner, name)


def _host_seconds(engine, run) -> dict:
    """Rank 0's host seconds in each of ``HOST_PARTS`` while ``run()`` runs (no device sync:
    launch and Python time, what a host-bound step is made of)."""
    totals = {part: [0, 0.0] for part in HOST_PARTS}

    @contextlib.contextmanager
    def timed(part: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            totals[part][0] += 1
            totals[part][1] += time.perf_counter() - t0
    start = time.perf_counter()
    with _around_host_parts(engine, timed):
        run()
        _sync()
    wall = time.perf_counter() - start
    return {"wall_s": round(wall, 4)} | {f"{k}_calls": v[0] for k, v in totals.items()} | {
        f"{k}_share": round(v[1] / wall, 3) for k, v in totals.items()}


def _idle(prof, events: list) -> dict:
    """The device's busy time (the union of ``events``, ``_device_events``) and idle gaps,
    charged to the host part running when each began (``samebits.tools.timeline``), in
    seconds."""
    kernels = [(e.time_range.start, e.time_range.end) for e in events]
    ranges = [(e.name[len("host."):], e.time_range.start, e.time_range.end) for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("host.")]
    report = idle_report(kernels, ranges)

    def seconds(table: dict) -> dict:
        return {k: [round(v["total"] / 1e6, 4), v["count"]] for k, v in table.items()}
    return {"busy_union_s": round(report["busy"] / 1e6, 4),
            "span_s": round(report["span"] / 1e6, 4),
            "idle_s": round(report["idle"] / 1e6, 4),
            "idle_by_host_s_count": seconds(report["idle_by_host"]),
            "idle_by_size_s_count": seconds(report["idle_by_size"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="benchmarks/configs/qwen3-8b.json")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--host-ranges", action="store_true",
                   help="also record host activity, so each idle gap is charged to the host part "
                        "running when it began (slows the profiled run's host a little)")
    p.add_argument("--trace", default=None,
                   help="a folder: each workload's profile written there as a gzipped Chrome "
                        "trace (<workload>_tp<N>.json.gz)")
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS),
                   default=["decode-bs1", "decode-bs64", "prefill"])
    p.add_argument("--push", type=int, nargs="?", const=1, default=None, choices=(0, 1, 2),
                   help="SAMEBITS_TP_PUSH on every rank, inherited by the spawned ranks "
                        "(--push: 1; unset: the engine's default)")
    args = p.parse_args()
    if args.push is not None:
        os.environ["SAMEBITS_TP_PUSH"] = str(args.push)
    push = wanted(1, args.tp) if args.tp > 1 else 0
    from samebits import LLM, SamplingParams
    llm = LLM(args.model, load_format="dummy", dtype=args.dtype, tensor_parallel_size=args.tp,
              max_num_seqs=64, max_model_len=2048, enable_prefix_caching=False)
    vocab = llm.engine.loaded.model_config.vocab_size
    for name in args.workloads:
        n, prompt, gen = WORKLOADS[name]
        prompts = [[(7 * i + j) % (vocab - 1) + 1 for j in range(prompt)] for i in range(n)]
        params = SamplingParams(max_tokens=gen, ignore_eos=True, temperature=0.0)
        llm.generate(prompts, params, use_tqdm=False)
        tagged = contextlib.nullcontext()
        activities = [ACTIVITY]
        if args.host_ranges:  # the host parts as ranges, recorded with the host's activity
            tagged = _around_host_parts(llm.engine, lambda part: record_function(f"host.{part}"))
            activities = list({ACTIVITY, ProfilerActivity.CPU})
        with profile(activities=activities) as prof, tagged:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            _sync()
            wall = time.perf_counter() - start
        events = _device_events(prof)
        summary = _summary(events, wall, args.top, comm_names(push, args.tp))
        print(json.dumps({"tp": args.tp, "push": push, "workload": name, "requests": n,
                          "prompt": prompt, "generated": gen} | summary | _idle(prof, events)),
              flush=True)
        if args.trace:  # torch gzips a path ending in .gz
            os.makedirs(args.trace, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.trace, f"{name}_tp{args.tp}.json.gz"))
        host = _host_seconds(llm.engine, partial(llm.generate, prompts, params, use_tqdm=False))
        print(json.dumps({"tp": args.tp, "workload": name, "host": host}), flush=True)
    llm.engine.runner.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
