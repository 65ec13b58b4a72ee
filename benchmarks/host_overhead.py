"""Eager wall time against GPU time, invariant op vs stock op, same run. JSON lines.

    python benchmarks/host_overhead.py            # linear at Qwen3-8B shapes, M <= 128; rms_norm
    python benchmarks/host_overhead.py --cprofile # where the host time of one op goes
    python benchmarks/host_overhead.py --breakdown # host time of each layer of one call

``wall_us``: microseconds per call of N back-to-back eager calls followed by one synchronize (what
an eager caller -- override mode, prefill, the trainer -- pays per op; the larger of host and GPU
time). ``gpu_us``: the same call replayed from a CUDA graph (no host work; captured outside
``as_captured``, so the eager kernel variants: no programmatic dependent launch). ``host_us``: the host
time per call alone (the loop's time before the final synchronize, the GPU kept busy). Ratios:
invariant / stock (target: wall <= 1.1x).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import samebits.ops as ops
from samebits.ops.triton.launcher import Descriptor, _host_args

LINEAR = [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)]
MS = [1, 16, 64, 128]


def gpu_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return do_bench(g.replay, warmup=10, rep=50, return_mode="median") * 1e3


def wall_and_host_us(fn, n: int = 300) -> tuple[float, float]:
    """(wall, host) us per call of one round of ``n`` calls (after 10 warm-up calls)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t2 - t0) / n * 1e6, (t1 - t0) / n * 1e6


def row(op: str, shape: dict, inv, stock, rounds: int = 7) -> dict:
    """Rounds of the invariant and the stock op alternate (the host's speed drifts between
    rounds); each figure is the best round."""
    samples = [(wall_and_host_us(inv), wall_and_host_us(stock)) for _ in range(rounds)]
    iw, ih = min(s[0][0] for s in samples), min(s[0][1] for s in samples)
    sw, sh = min(s[1][0] for s in samples), min(s[1][1] for s in samples)
    ig, sg = gpu_us(inv), gpu_us(stock)
    r = {"op": op, **shape, "invariant_wall_us": round(iw, 1), "stock_wall_us": round(sw, 1),
         "ratio_wall": round(iw / sw, 3), "invariant_host_us": round(ih, 1),
         "stock_host_us": round(sh, 1), "invariant_gpu_us": round(ig, 1),
         "stock_gpu_us": round(sg, 1), "ratio_gpu": round(ig / sg, 3)}
    print(json.dumps(r), flush=True)
    return r


def bench(args: argparse.Namespace) -> list[dict]:
    rows = []
    for k, n in LINEAR:
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
        for m in MS:
            x = torch.randn(m, k, device="cuda").bfloat16()
            rows.append(row("linear", {"M": m, "K": k, "N": n},
                            lambda x=x, w=w: ops.linear(x, w), lambda x=x, w=w: F.linear(x, w)))
    h = 4096
    wn = torch.randn(h, device="cuda").bfloat16()
    for m in MS:
        x = torch.randn(m, h, device="cuda").bfloat16()
        rows.append(row("rms_norm", {"M": m, "H": h}, lambda x=x: ops.rms_norm(x, wn, 1e-6),
                        lambda x=x: F.rms_norm(x, (h,), wn, 1e-6)))
    return rows


def cprofile(n: int = 2000) -> None:
    """Top host functions of ``n`` linear calls (M=16, 4096x4096) and ``n`` rms_norm calls."""
    x = torch.randn(16, 4096, device="cuda").bfloat16()
    w = torch.randn(4096, 4096, device="cuda").bfloat16()
    wn = torch.randn(4096, device="cuda").bfloat16()
    for name, fn in (("linear", lambda: ops.linear(x, w)),
                     ("rms_norm", lambda: ops.rms_norm(x, wn, 1e-6))):
        fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"== {name}: {n} calls")
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def host_only_us(fn, n: int = 200) -> float:
    """Host microseconds per call: ``n`` calls timed before a synchronize (n stays below the
    launch queue's depth, so the host never waits for the device), best of 5."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
        torch.cuda.synchronize()
    return best * 1e6


def _last_launch(fn):
    """(launcher, key, grid, args, options) of ``fn``'s last launch, taken through
    ``Launcher.__call__`` (the direct route turned off for the call)."""
    from samebits.ops.triton.launcher import Launcher
    seen = {}
    real, direct = Launcher.__call__, Launcher.direct

    def spy(self, key, grid, *args, **options):
        seen["call"] = (self, key, grid, args, options)
        return real(self, key, grid, *args, **options)

    Launcher.__call__, Launcher.direct = spy, lambda self, key, device: None
    try:
        fn()
    finally:
        Launcher.__call__, Launcher.direct = real, direct
    return seen["call"]


def _layers(op, stock, alloc) -> dict:
    """Host us per call of ``stock``, ``alloc``, ``op`` and of ``op``'s last launch replayed
    through the Launcher, its bound launch (tensors), its direct launch (int pointers, encoded
    descriptors: the op's own route) and compiled.run (fixed arguments)."""
    launcher, key, grid, args, opts = _last_launch(op)
    stream = torch.cuda.current_stream().cuda_stream
    device = torch.cuda.current_device()
    bound = launcher._launch[(device, key)]
    compiled = bound.compiled
    host_args = _host_args(args)  # compiled.run takes Triton's descriptors
    direct = launcher.direct(key, device)  # None with a launch hook set or another Triton
    descs = tuple(a for a in args if isinstance(a, Descriptor))
    maps = direct.tensor_maps(descs) if descs and direct is not None else ()
    c_args = (*maps, *(a.data_ptr() if isinstance(a, torch.Tensor) else a
                       for a in args if not isinstance(a, Descriptor)))
    grid3 = (*grid, 1, 1)[:3]
    cases = {"stock": stock, "alloc": alloc, "whole_op": op,
             "Launcher": lambda: launcher(key, grid, *args, **opts),
             "bound": lambda: bound(grid, stream, args),
             "direct_int_pointers": (lambda: direct(grid3, c_args)) if direct else None,
             "compiled.run": lambda: compiled.run(
                 grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata, None, None,
                 None, *host_args),
             "device+stream": lambda: (torch.cuda.is_initialized(), torch._C._cuda_getCurrentRawStream(
                 torch._C._cuda_getDevice()))}
    return {k: round(host_only_us(f), 2) for k, f in cases.items() if f is not None}


def _linear_layers(m: int, n: int) -> dict:
    x = torch.randn(m, 4096, device="cuda").bfloat16()
    w = torch.randn(n, 4096, device="cuda").bfloat16()
    return _layers(lambda: ops.linear(x, w), lambda: F.linear(x, w),
                   lambda: torch.empty(m, n, device="cuda", dtype=torch.bfloat16))


def _norm_layers(m: int) -> dict:
    x = torch.randn(m, 4096, device="cuda").bfloat16()
    wn = torch.randn(4096, device="cuda").bfloat16()
    return _layers(lambda: ops.rms_norm(x, wn, 1e-6),
                   lambda: F.rms_norm(x, (4096,), wn, 1e-6), lambda: torch.empty_like(x))


def breakdown() -> None:
    """Host us per call of each layer of one op (JSON lines): stock op, allocation, the whole
    op, its Launcher, compiled.run."""
    from samebits.ops.triton import launcher
    runtime = launcher.knobs.runtime
    print(json.dumps({"launch_enter_hook": repr(runtime.launch_enter_hook),
                      "launch_exit_hook": repr(runtime.launch_exit_hook)}), flush=True)
    for m, n in ((1, 4096), (16, 4096), (128, 4096), (16, 24576)):
        print(json.dumps({"op": "linear", "M": m, "N": n, **_linear_layers(m, n)}), flush=True)
    for m in (1, 128):
        print(json.dumps({"op": "rms_norm", "M": m, **_norm_layers(m)}), flush=True)
    for n in (4096, 6144, 24576):
        print(json.dumps({"op": "linear_tiles", "M": 128, "N": n, **_tile_gpu_us(128, n)}),
              flush=True)


def _tile_gpu_us(m: int, n: int, k: int = 4096) -> dict:
    """GPU us (graph replays) of the M-row product with the TMA tile and pointer-kernel tiles."""
    from samebits.ops.triton import linear as tl_linear
    x = torch.randn(m, k, device="cuda").bfloat16()
    w = torch.randn(n, k, device="cuda").bfloat16()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    tiles = {"picked": tl_linear.pick_config(m, n, k, x.dtype, plain_tma=True),
             "ptr_64x64x128": tl_linear.GemmConfig(64, 64, 128, 4, 4),
             "ptr_64x128x64": tl_linear.GemmConfig(64, 128, 64, 4, 4),
             "ptr_128x64x64": tl_linear.GemmConfig(128, 64, 64, 4, 4),
             "ptr_128x128x64": tl_linear.GemmConfig(128, 128, 64, 8, 3)}
    row = {}
    for name, cfg in tiles.items():
        row[name] = round(gpu_us(lambda cfg=cfg: tl_linear.run(x, w, None, out, cfg, 1)), 2)
    row["stock"] = round(gpu_us(lambda: F.linear(x, w)), 2)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cprofile", action="store_true")
    p.add_argument("--breakdown", action="store_true")
    args = p.parse_args()
    if args.breakdown:
        breakdown()
        return
    if args.cprofile:
        cprofile()
        return
    rows = bench(args)
    worst = {op: max(r["ratio_wall"] for r in rows if r["op"] == op) for op in ("linear", "rms_norm")}
    print(json.dumps({"bench": "host_overhead", "device": torch.cuda.get_device_name(),
                      "worst_ratio_wall": worst}))


if __name__ == "__main__":
    main()
