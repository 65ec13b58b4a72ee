"""Invariant Triton kernels vs the stock torch ops, on one CUDA device. Prints JSON lines:
{op, shape, dtype, invariant_us, stock_us, ratio, ...} and a summary per op group at the end.

    python benchmarks/kernels.py                 # the issue-4 targets
    python benchmarks/kernels.py --sweep linear  # tile configs / segment counts, for tuning
    python benchmarks/kernels.py --sweep attention

Timing: ``triton.testing.do_bench`` median; it clears the L2 cache (a 256 MB write) before every
repetition, so every call reads cold inputs -- the same effect as rotating input sets. Inputs are
fresh random data (never zeros). Ratio = invariant time / stock time, both measured in this run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from samebits.config import EngineConfig
from samebits.ops.backend import AttentionMetadata
from samebits.ops.rope import qkv_rope_store as composed_prologue
from samebits.ops.standard import StandardBackend
from samebits.ops.standard_cuda import StandardCudaBackend
from samebits.ops.triton import activation as ACT
from samebits.ops.triton import attention as A
from samebits.ops.triton import linear as L
from samebits.ops.triton import rms_norm as RN
from samebits.ops.triton import rope as ROPE
from samebits.ops.triton import softmax as SM

LINEAR_SHAPES = [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096), (4096, 151936)]
LINEAR_MS = [1, 8, 32, 128, 512, 2048, 8192]
ROWS: list[dict] = []


def us(fn, *args, rep: int = 100, graph: bool = True, **kwargs) -> float:
    """Median GPU microseconds of fn(*args, **kwargs), replayed from a CUDA graph (so host launch
    overhead -- large for Triton's Python launcher -- is not counted, for either side)."""
    fn(*args, **kwargs)  # compile / autotune outside the capture
    torch.cuda.synchronize()
    if not graph:
        return do_bench(lambda: fn(*args, **kwargs), warmup=max(5, rep // 4), rep=rep,
                        return_mode="median") * 1e3
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(*args, **kwargs)
    t = do_bench(g.replay, warmup=max(5, rep // 4), rep=rep, return_mode="median") * 1e3
    del g
    return t


def host_us(fn, *args, n: int = 200, **kwargs) -> float:
    """Host (CPU) microseconds per eager call, the device kept busy so the queue never drains."""
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn(*args, **kwargs)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def kernel_us(fn, *args, n: int = 20, **kwargs) -> dict[str, float]:
    """Mean device microseconds per call of each kernel fn launches (torch.profiler; L2 warm,
    so a breakdown, not a figure to report)."""
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn(*args, **kwargs)
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            out[e.key[:40]] = round(e.device_time_total / n, 2)
    return out


def emit(op: str, shape: dict, dtype: str, inv: float, stock: float, **extra) -> None:
    row = {"op": op, "shape": shape, "dtype": dtype, "invariant_us": round(inv, 2),
           "stock_us": round(stock, 2), "ratio": round(inv / stock, 3), **extra}
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def bench_linear(sweep: bool) -> None:
    for k, n in LINEAR_SHAPES:
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
        for m in LINEAR_MS:
            x = torch.randn(m, k, device="cuda").bfloat16()
            if sweep and m < 128:
                continue
            stock = us(F.linear, x, w)
            if not sweep:
                emit("linear", {"M": m, "K": k, "N": n}, "bf16", us(L.linear, x, w), stock,
                     config=L.pick_config(m, n, k, x.dtype, plain_tma=True).__dict__,
                     segments=L.num_segments(k, n), invariant_eager_us=round(
                         us(L.linear, x, w, graph=False), 2),
                     stock_eager_us=round(us(F.linear, x, w, graph=False), 2))
                continue
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            for cfg in _linear_candidates(m):
                try:
                    t = us(L.run, x, w, None, out, cfg, 1, rep=30)
                except Exception as e:  # noqa: BLE001 (a config that does not fit: skip it)
                    print(json.dumps({"skipped": cfg.__dict__, "error": str(e)[:80]}), flush=True)
                    continue
                emit("linear_sweep", {"M": m, "K": k, "N": n}, "bf16", t, stock,
                     config=cfg.__dict__, segments=1)
        del w
        torch.cuda.empty_cache()


def _linear_candidates(m: int) -> list[L.GemmConfig]:
    G = L.GemmConfig
    if m <= 128:
        return [G(64, 64, 128, 4, 4), G(64, 128, 128, 4, 3, tma=True),
                G(64, 128, 128, 4, 4, tma=True), G(64, 64, 128, 4, 4, tma=True),
                G(128, 64, 128, 4, 3, tma=True), G(64, 128, 256, 4, 2, tma=True),
                G(64, 256, 128, 8, 3, tma=True), G(64, 64, 256, 4, 3, tma=True)]
    if m <= 512:
        return [G(128, 256, 64, 8, 3, tma=True), G(128, 256, 128, 8, 2, tma=True),
                G(64, 256, 64, 4, 4, tma=True), G(256, 128, 64, 8, 3, tma=True),
                G(128, 128, 128, 8, 3, tma=True), G(64, 128, 128, 4, 4, tma=True),
                G(128, 256, 64, 8, 3, tma=True, group_m=4)]
    return [G(128, 256, 64, 8, 3, tma=True), G(128, 256, 128, 8, 2, tma=True),
            G(256, 128, 64, 8, 3, tma=True), G(128, 256, 64, 8, 3, tma=True, group_m=16),
            G(128, 256, 64, 8, 3, tma=True, group_m=4), G(128, 128, 64, 8, 4, tma=True)]


def _add_then_norm(std: StandardBackend, x: torch.Tensor, r: torch.Tensor, w: torch.Tensor):
    h = x + r
    return std.rms_norm(h, w, 1e-6), h


def _add_then_f_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor):
    h = x + r
    return F.rms_norm(h, (h.shape[-1],), w, 1e-6), h


def bench_norms() -> None:
    std = StandardBackend()
    for m in (1, 32, 256, 2048, 8192):
        x = torch.randn(m, 4096, device="cuda").bfloat16()
        r = torch.randn(m, 4096, device="cuda").bfloat16()
        w = torch.rand(4096, device="cuda").bfloat16()
        hf = us(std.rms_norm, x, w, 1e-6)
        fused = us(F.rms_norm, x, (4096,), w, 1e-6)
        emit("rms_norm", {"M": m, "H": 4096}, "bf16", us(RN.rms_norm, x, w, 1e-6),
             min(hf, fused), stock_hf_composite_us=round(hf, 2), stock_F_rms_norm_us=round(fused, 2),
             invariant_host_us=round(host_us(RN.rms_norm, x, w, 1e-6), 1),
             stock_host_us=round(host_us(F.rms_norm, x, (4096,), w, 1e-6), 1))
        hf = us(_add_then_norm, std, x, r, w)
        fused = us(_add_then_f_norm, x, r, w)
        emit("add_rms_norm", {"M": m, "H": 4096}, "bf16", us(RN.add_rms_norm, x, r, w, 1e-6),
             min(hf, fused), stock_hf_composite_us=round(hf, 2), stock_F_rms_norm_us=round(fused, 2))
    for v in (32768, 151936):
        for m in (1, 32, 256, 2048):
            x = torch.randn(m, v, device="cuda") * 4
            emit("log_softmax", {"M": m, "V": v}, "fp32", us(SM.log_softmax, x),
                 us(torch.log_softmax, x, -1))
            emit("softmax", {"M": m, "V": v}, "fp32", us(SM.softmax, x),
                 us(torch.softmax, x, -1))


def _silu_then_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _composed_prologue(*args) -> torch.Tensor:
    return composed_prologue(RN.rms_norm, *args)


def bench_fused() -> None:
    """The decoder's fused elementwise kernels against the compositions they replace (Qwen3-8B
    shapes, bf16): silu_mul on gate_up's halves; the attention prologue (q/k norm + RoPE + KV
    store), ``stock_us`` being the composition over the invariant rms_norm."""
    hq, hkv, d, inter, blocks = 32, 8, 128, 12288, 512
    for m in (1, 32, 256, 2048):
        gate, up = torch.randn(m, 2 * inter, device="cuda").bfloat16().chunk(2, dim=-1)
        emit("silu_mul", {"M": m, "I": inter}, "bf16", us(ACT.silu_mul, gate, up),
             us(_silu_then_mul, gate, up), kernels=len(kernel_us(ACT.silu_mul, gate, up)))
        qkv = torch.randn(m, (hq + 2 * hkv) * d, device="cuda").bfloat16()
        cos, sin = torch.rand(2, m, d, device="cuda").bfloat16()
        qn, kn = torch.rand(d, device="cuda").bfloat16(), torch.rand(d, device="cuda").bfloat16()
        kc = torch.zeros(blocks, 16, hkv, d, device="cuda").bfloat16()
        vc = torch.zeros_like(kc)
        slots = torch.randperm(blocks * 16, device="cuda")[:m]
        args = (qkv, cos, sin, qn, kn, 1e-6, kc, vc, slots, hq, hkv, d)
        emit("qkv_rope_store", {"M": m, "Hq": hq, "Hkv": hkv, "D": d}, "bf16",
             us(ROPE.qkv_rope_store, *args), us(_composed_prologue, *args),
             stock_kernels=len(kernel_us(_composed_prologue, *args)))


def _paged(kc_contig: torch.Tensor, bs: int, perm: torch.Tensor) -> tuple[torch.Tensor, list]:
    """[B, Hkv, L, D] contiguous -> paged [B*L/bs, bs, Hkv, D] at blocks ``perm``, tables."""
    b, hkv, n, d = kc_contig.shape
    per = n // bs
    paged = torch.empty(b * per, bs, hkv, d, device="cuda", dtype=kc_contig.dtype)
    for i in range(b):  # one sequence at a time keeps the temporary small
        paged[perm[i * per:(i + 1) * per].cuda()] = kc_contig[i].permute(1, 0, 2).reshape(
            per, bs, hkv, d)
    return paged, perm.view(b, per).tolist()


def _meta(tables: list, seq_lens: list[int], q_lens: list[int], bs: int) -> AttentionMetadata:
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        block_tables=torch.tensor(tables, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64, device="cuda"),
        seq_lens_list=tuple(seq_lens), query_start_loc_list=tuple(qsl), block_size=bs,
        split_size=EngineConfig.attention_split_size)
    return A.plan_attention(meta)


def bench_decode(variants: list[dict]) -> None:
    hq, hkv, d, bs = 32, 8, 128, 16
    gen = torch.Generator().manual_seed(0)
    for b in (1, 16, 128):
        for ctx in (512, 4096, 32768):
            k = torch.randn(b, hkv, ctx, d, device="cuda").bfloat16()
            v = torch.randn(b, hkv, ctx, d, device="cuda").bfloat16()
            perm = torch.randperm(b * ctx // bs, generator=gen)
            kc, tables = _paged(k, bs, perm)
            vc, _ = _paged(v, bs, perm)
            q = torch.randn(b, hq, d, device="cuda").bfloat16()
            meta = _meta(tables, [ctx] * b, [1] * b, bs)
            scale = d ** -0.5
            q4 = q[:, :, None]
            stock = us(F.scaled_dot_product_attention, q4, k, v, scale=scale, enable_gqa=True)
            ref = F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
            std = StandardCudaBackend()
            std_meta = std.plan_attention(meta)
            std_us = round(us(std.attention, q, kc, vc, std_meta, scale), 1)
            for var in variants:
                var = dict(var)
                split = var.pop("split_size", EngineConfig.attention_split_size)
                launch = dataclasses.replace(A.DEFAULT_LAUNCH, **var)  # from the engine's
                meta = dataclasses.replace(meta, split_size=split, plan=None)
                meta = dataclasses.replace(meta, plan=A.plan(meta, launch=launch))
                out = A.attention(q, kc, vc, meta, scale)
                err = (out.float() - ref[:, :, 0].float()).abs().max().item()
                t = us(A.attention, q, kc, vc, meta, scale)
                emit("attention_decode", {"batch": b, "context": ctx, "hq": hq, "hkv": hkv,
                                          "d": d}, "bf16", t, stock,
                     max_abs_err=err, launch=dataclasses.asdict(launch), split_size=split,
                     standard_paged_us=std_us,
                     standard_split=std_meta.plan.split_size,
                     invariant_host_us=round(host_us(A.attention, q, kc, vc, meta, scale), 1),
                     kernels_us=kernel_us(A.attention, q, kc, vc, meta, scale),
                     stock_kernels_us=kernel_us(F.scaled_dot_product_attention, q4, k, v,
                                                scale=scale, enable_gqa=True))
            del k, v, kc, vc
            torch.cuda.empty_cache()


def bench_prefill(variants: list[dict]) -> None:
    hq, hkv, d, bs = 32, 8, 128, 16
    gen = torch.Generator().manual_seed(1)
    for n in (512, 4096, 16384):
        k = torch.randn(1, hkv, n, d, device="cuda").bfloat16()
        v = torch.randn(1, hkv, n, d, device="cuda").bfloat16()
        perm = torch.randperm(n // bs, generator=gen)
        kc, tables = _paged(k, bs, perm)
        vc, _ = _paged(v, bs, perm)
        q = torch.randn(n, hq, d, device="cuda").bfloat16()
        qc = q.transpose(0, 1)[None].contiguous()
        scale = d ** -0.5
        stock = us(F.scaled_dot_product_attention, qc, k, v, is_causal=True, scale=scale,
                   enable_gqa=True)
        backends = {}
        for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
            try:
                with sdpa_kernel(getattr(SDPBackend, name)):
                    backends[name] = round(us(F.scaled_dot_product_attention, qc, k, v,
                                              is_causal=True, scale=scale, enable_gqa=True), 1)
            except RuntimeError as e:
                backends[name] = str(e)[:60]
        ref = F.scaled_dot_product_attention(qc, k, v, is_causal=True, scale=scale,
                                             enable_gqa=True)[0].transpose(0, 1)
        base = _meta(tables, [n], [n], bs)
        for var in variants:
            var = dict(var)
            block_m = var.pop("block_m", None)
            split = var.pop("split_size", EngineConfig.attention_split_size)
            launch = dataclasses.replace(A.DEFAULT_LAUNCH, **var)  # from the engine's
            split_meta = dataclasses.replace(base, split_size=split)
            meta = dataclasses.replace(split_meta, plan=A.plan(split_meta, block_m=block_m,
                                                               launch=launch))
            out = A.attention(q, kc, vc, meta, scale)
            err = (out.float() - ref.float()).abs().max().item()
            t = us(A.attention, q, kc, vc, meta, scale)
            flops = 4 * hq * d * n * n / 2
            emit("attention_prefill", {"tokens": n, "hq": hq, "hkv": hkv, "d": d}, "bf16", t,
                 stock, max_abs_err=err, tflops=round(flops / t / 1e6, 1),
                 launch={**dataclasses.asdict(launch), "block_m": meta.plan.block_m},
                 split_size=split,
                 stock_by_backend_us=backends)
        del k, v, kc, vc
        torch.cuda.empty_cache()
    print(json.dumps({"compiled": compiled_info(A._prefill_kernel)}), flush=True)
    if A._prefill_gluon_kernel is not None:
        print(json.dumps({"compiled_gluon": compiled_info(A._prefill_gluon_kernel)}), flush=True)


def compiled_info(fn) -> list[dict]:
    """Registers, spills and shared memory of every compiled specialization of a Triton kernel
    (the JIT cache's layout is Triton's internal: best effort)."""
    out = []
    try:
        for caches in fn.device_caches.values():
            for key, k in caches[0].items():
                out.append({"regs": k.n_regs, "spills": k.n_spills, "shared": k.metadata.shared,
                            "warps": k.metadata.num_warps, "stages": k.metadata.num_stages,
                            "key": str(key)[-160:]})
    except (AttributeError, IndexError, TypeError) as e:
        out.append({"error": repr(e)[:200]})
    return out


def summary() -> None:
    groups: dict[str, list[float]] = {}
    for r in ROWS:
        groups.setdefault(r["op"], []).append(r["ratio"])
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", file=sys.stderr)
    for op, rs in groups.items():
        gm = math.exp(sum(math.log(x) for x in rs) / len(rs))
        print(f"{op:20s} n={len(rs):3d} geomean={gm:.3f} max={max(rs):.3f} min={min(rs):.3f}",
              file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="linear,norms,fused,decode,prefill")
    ap.add_argument("--sweep", default="", help="linear | attention | split")
    args = ap.parse_args()
    torch.manual_seed(0)
    ops = args.ops.split(",")
    if "linear" in ops:
        bench_linear(args.sweep == "linear")
    if "norms" in ops:
        bench_norms()
    if "fused" in ops:
        bench_fused()
    sweep_att = args.sweep == "attention"
    if args.sweep == "split":  # the split size is part of the arithmetic: a default to choose
        splits = [{"split_size": s, "merge_scan": m} for s in (128, 256) for m in (False, True)]
        if "decode" in ops:
            bench_decode(splits)
        if "prefill" in ops:
            bench_prefill([{"split_size": s} for s in (128, 256, 512)])
    elif "decode" in ops:
        base = {"split_warps": 4, "split_stages": 2}
        bench_decode([{**base, "decode_gluon": False}, {**base, "decode_gluon": True},
                      {**base, "decode_gluon": True, "merge_warps": 4},
                      {**base, "decode_gluon": True, "merge_warps": 2, "merge_stages": 24}]
                     if sweep_att else [{}])
    if "prefill" in ops and args.sweep != "split":
        bench_prefill([{"prefill_gluon": False, "block_m": 128, "prefill_stages": 3},
                       {"prefill_gluon": True}] if sweep_att else [{}])
    summary()


if __name__ == "__main__":
    main()
