"""Batch-invariant ``linear`` on CUDA: a Triton GEMM whose K order is fixed by (K, N) alone.

Arithmetic contract (what fixes the bits of ``out[i, j]``):

- K is cut into ordered segments, functions of the weight shape and the caller's ``k_bounds``
  only: by default ``num_segments(K, N)`` segments of ``segment_len(K, N)`` elements (a multiple of
  ``SEGMENT_ALIGN``; the last one may be shorter); with ``k_bounds`` (the row-parallel linears'
  K chains, ``samebits.ops.backend``) exactly those: near-equal ones (a run of lengths q+1 then
  q, as ``samebits.ops.backend.bounds`` cuts them: a ``SegmentLayout``) by the kernels below,
  others (chains merged from uneven KV-head segments) one product per range on its own slice
  (``_slice_partials``: the same bits), tree-summed in torch.
- Each segment is accumulated from zero in fp32 by ``tl.dot`` over ascending K (the tensor cores
  take 16 K-elements per step; fp32 inputs use ``input_precision="ieee"``, plain FMAs).
  ``num_segments`` is 1 for every shape, i.e. a plain fp32 accumulation over all of K.
- More than one segment, ``FUSED_MIN_M`` < M <= ``SPLIT_MAX_M``, a power of two up to ``FUSED_MAX_SEGS``
  even segments: one program per output tile computes every segment's partial and adds them in
  the tree order below in registers (the fused schedule: the same adds, no partials buffer, one
  launch). Otherwise one program per (output tile, segment) writes the segment's fp32
  partial to an [S, M, N] buffer (the split schedule), and the partials are added in
  ``samebits.ops.backend.tree_sum``'s balanced tree order -- by ``_sum_partials_kernel`` (pairs,
  then pairs of pairs) when S is a power of two up to ``TREE_KERNEL_MAX``, else by ``tree_sum``
  in torch -- then the bias is added in fp32 and the sum is cast once to the output dtype (with
  ``k_bounds``: cast first, then the bias added in the output dtype, as every backend does for
  segmented K). ``partials`` returns the fp32 partials unsummed (a tensor-parallel rank's
  share), ``linear_sum`` their tree sum in fp32 (a rank's own subtree), and ``sum_tree`` adds
  given fp32 partials (the ranks' gathered sums) and casts, in ``_sum_partials_kernel``'s one
  launch where it takes the count.

Tile shapes (BLOCK_M/N/K, warps, stages: ``linear_tiles.py``) follow the row count M for speed; on
Hopper they do not change the bits (docs/DESIGN.md section 2, re-checked by
tests/gpu/test_linear_bits.py). With one segment, rows above 64 take ``_linear_tma_kernel``
(persistent, TMA loads), smaller ones the pointer kernel; a tensor-parallel rank's one chain
(an fp32 output, maybe a peer's) takes ``_segmented_tma_kernel`` above 64 rows (its output in
two column halves on the widest tile), the pointer kernel below. More than one segment above
64 rows, 16-bit and every segment whole BLOCK_K steps: ``_segmented_tma_kernel`` (persistent,
TMA loads) adds the partials in registers in the same tree order, casts and stores once -- the
same bits as the split schedule, without the [S, M, N] buffer and the sum kernel; other
segmented products take the split schedule.

A second output (``linear_sum``'s ``peer_out``: a tensor-parallel peer's slot, mapped here): the
kernel that stores the final fp32 values -- the pointer kernel's one chain, the fused tree's
program, ``_sum_partials_kernel``, ``_segmented_tma_kernel`` (plain masked stores beside its TMA
store; its tile's shared memory budgets the layout conversion they take) -- stores each tile's
same registers there too (``HAS_PEER``); torch's tree sum copies its result into both. Without
it ``peer_ptr`` is None, a constexpr, and each kernel compiles as it did without the parameter.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton

from samebits.ops.backend import KBounds, check_k_bounds, check_sum_outs, into_sum_outs, tree_sum
from samebits.ops.triton import linear_kernels as K
from samebits.ops.triton.launcher import Descriptor, Launcher, alignment, programmatic
from samebits.ops.triton.linear_tiles import (
    FUSED_MAX_SEGS,
    FUSED_MIN_M,
    MIN_BLOCK_K,
    SEGMENTED_TILE,
    SEGMENTED_TMA_MAX,
    SMEM_BYTES,
    SPLIT_MAX_M,
    GemmConfig,
    SegmentLayout,
    near_equal,
    num_segments,
    pick_config,
    segmented_config,
    smem_bytes,
    uniform_layout,
)

TREE_KERNEL_MAX = 64  # the most segments _sum_partials_kernel adds (a power of two)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           k_bounds: KBounds | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K].T (+ b) -> [..., N]; see the module docstring for the contract."""
    k, n = x.shape[-1], w.shape[0]
    flat = x.dim() == 2
    x2 = x if flat else x.reshape(-1, k)
    m = x2.shape[0]
    out = x2.new_empty(m, n)
    if k_bounds is None:
        if m and n:
            run(x2, w, b, out)
        return out if flat else out.reshape(*x.shape[:-1], n)
    if not near_equal(k_bounds):  # chains merged from uneven segments
        out = sum_tree(_slice_partials(x, w, k_bounds), x.dtype)
        return out if b is None else out + b
    segments = SegmentLayout.from_bounds(k_bounds, k)
    cfg = segmented_config(m, n, k, x.dtype, segments) if segments.count > 1 else None
    if m and n:
        run(x2, w, None, out, cfg, segments)
    if b is not None:
        out = out + b
    return out.reshape(*x.shape[:-1], n)


def partials(x: torch.Tensor, w: torch.Tensor, k_bounds: KBounds) -> torch.Tensor:
    """[S, ..., N] fp32: each K segment's partial, the very values ``linear`` with ``k_bounds``
    adds."""
    if not near_equal(k_bounds):
        return _slice_partials(x, w, k_bounds)
    return _fp32_product(x, w, SegmentLayout.from_bounds(k_bounds, x.shape[-1]), keep=True)


def linear_sum(x: torch.Tensor, w: torch.Tensor, k_bounds: KBounds,
               out: torch.Tensor | None = None, peer_out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """[..., N] fp32: ``tree_sum(partials(x, w, k_bounds))``, uncast (a tensor-parallel rank's
    sum of its own segments), in the schedule ``run`` picks (the partials tree-summed in
    registers, or written and summed by ``_sum_partials_kernel``). ``out``: a contiguous fp32
    [..., N] tensor on x's device the kernels store into (``check_sum_outs``), returned.
    ``peer_out``: another such tensor (a peer's slot, mapped on this device) into which the
    kernel that stores the sum stores each tile's same values again, as it goes."""
    check_sum_outs(x, w.shape[0], torch.float32, out, peer_out)
    if not near_equal(k_bounds):
        return into_sum_outs(tree_sum(_slice_partials(x, w, k_bounds)), out, peer_out)
    layout = SegmentLayout.from_bounds(k_bounds, x.shape[-1])
    return _fp32_product(x, w, layout, keep=False, out=out, peer=peer_out)


def _slice_partials(x: torch.Tensor, w: torch.Tensor, k_bounds: KBounds) -> torch.Tensor:
    """[S, ..., N] fp32: each K range's product alone, on its own columns (strided views: no
    copy) -- the bits the segmented kernels give a segment -- for ranges that are not
    near-equal (chains merged from uneven KV-head segments), which those kernels do not take."""
    check_k_bounds(k_bounds, x.shape[-1])
    return torch.stack([_fp32_product(x[..., lo:hi], w[:, lo:hi], SegmentLayout(1, hi - lo),
                                      keep=True)[0] for lo, hi in k_bounds])


def _fp32_product(x: torch.Tensor, w: torch.Tensor, layout: SegmentLayout, keep: bool,
                  out: torch.Tensor | None = None, peer: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """x [..., K] @ w.T over ``layout``'s segments in fp32: [S, ..., N] partials (``keep``), or
    their tree sum [..., N]; into ``out`` (contiguous, [S, ..., N] or [..., N]: its elements in
    that order) when given, else a new tensor; the same values into ``peer`` (laid out as
    ``out``) when given."""
    *lead, k = x.shape
    n = w.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    parts = (layout.count,) if keep else ()
    if out is None:
        out = x2.new_empty(*parts, m, n, dtype=torch.float32)
    else:
        out = out.view(*parts, m, n)
    if peer is not None:
        peer = peer.view(*parts, m, n)
    if m and n:
        run(x2, w, None, out, segmented_config(m, n, k, x.dtype, layout), layout, peer)
    return out.reshape(*parts, *lead, n)


def sum_tree(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[S, ..., N] -> [..., N] in ``dtype``: ``tree_sum(parts).to(dtype)``. fp32 partials of a
    count ``tree_kernel_sums`` takes, summed into an fp32 / fp16 / bf16 output: one launch of
    ``_sum_partials_kernel`` (no host value of the data: CUDA-graph safe); else torch."""
    segs = parts.shape[0]
    if (parts.dim() < 2 or parts.dtype != torch.float32 or not tree_kernel_sums(segs)
            or dtype not in (torch.float32, torch.float16, torch.bfloat16)):
        return tree_sum(parts).to(dtype)
    parts = parts.contiguous()
    out = parts.new_empty(parts.shape[1:], dtype=dtype)
    mn = out.numel()
    if mn:
        pp, po = parts.data_ptr(), out.data_ptr()
        p = _sum_plan(mn, parts.shape[-1], segs, dtype, None, programmatic(parts),
                      alignment(pp & 15, pp & 15, po & 15))
        _SUM_PARTIALS(p.key, p.grid, parts, parts, out, None, *p.tail,  # parts: no bias
                      **p.options)
    return out


def run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor,
        cfg: GemmConfig | None = None, segments: int | SegmentLayout | None = None,
        peer: torch.Tensor | None = None) -> None:
    """Launch with an explicit tile config and segments (a count of uniform segments, or a
    layout; by default ``pick_config`` and ``num_segments``); benchmarks sweep these. ``out``
    [S, M, N] fp32 and no bias: the partials are left unsummed there. ``peer``: a tensor of
    out's shape, strides, dtype and device that receives out's values too, stored by the kernel
    that stores out's (``_Plan.peer``; the sum kernel's ``HAS_PEER``) from the same registers."""
    m, k = x.shape
    n = w.shape[0]
    contiguous = x.is_contiguous() and w.is_contiguous() and out.is_contiguous()
    if not contiguous:
        x = x if x.stride(-1) == 1 else x.contiguous()
        w = w if w.stride(-1) == 1 else w.contiguous()
        contiguous = x.is_contiguous() and w.is_contiguous() and out.is_contiguous()
    bias = b if b is not None else x
    device = x.get_device()
    if w.get_device() != device or bias.get_device() != device or out.get_device() != device:
        raise ValueError(f"linear: x is on {x.device}, w on {w.device}, out on {out.device}"
                         + ("" if b is None else f", b on {b.device}"))
    _check_peer(peer, out)
    px, pw, pb, po = x.data_ptr(), w.data_ptr(), bias.data_ptr(), out.data_ptr()
    pp = None if peer is None else peer.data_ptr()
    p = _plan(m, n, k, x.dtype, w.dtype, out.dtype, out.dim() == 3,
              None if b is None else b.dtype, x.stride(0), w.stride(0), out.stride(-2), cfg,
              segments, programmatic(x), (px & 15, pw & 15, pb & 15, po & 15), contiguous,
              None if pp is None else pp & 15)
    if p.tma or p.seg_tma:  # after the descriptors: the segmented kernel's peer, else the bias
        after = (peer, pp) if p.seg_tma else (bias, pb)
        _run_tma(p, x, w, after[0], out, (px, pw, po, after[1]), device)
        return
    target, pt = out, po
    if p.partials:
        target = x.new_empty(p.partials, m, n, dtype=torch.float32)
        pt = target.data_ptr()
    gemm_peer, gemm_pp = (peer, pp) if p.peer else (None, None)
    direct = _LINEAR.direct(p.key, device)
    if direct is not None:
        direct(p.grid, (px, pw, pb, pt, gemm_pp, *p.tail))
    else:
        _LINEAR(p.key, p.grid, x, w, bias, target, gemm_peer, *p.tail, **p.options)
    if p.partials and p.sum is None:  # a segment count the tree kernel does not take
        total = tree_sum(target)
        into_sum_outs(total if b is None else total + b.float(), out, peer)
    elif p.partials:
        _SUM_PARTIALS(p.sum.key, p.sum.grid, target, bias, out, peer, *p.sum.tail,
                      **p.sum.options)


def _check_peer(peer: torch.Tensor | None, out: torch.Tensor) -> None:
    """Raise, naming what differs, unless ``peer`` is None or laid out as ``out``."""
    if peer is None:
        return
    if (peer.shape != out.shape or peer.stride() != out.stride() or peer.dtype != out.dtype
            or peer.device != out.device):
        raise ValueError(f"linear: peer {tuple(peer.shape)} strides {peer.stride()} "
                         f"{peer.dtype} on {peer.device}; out {tuple(out.shape)} strides "
                         f"{out.stride()} {out.dtype} on {out.device}")


def _run_tma(p: _Plan, x: torch.Tensor, w: torch.Tensor, after: torch.Tensor | None,
             out: torch.Tensor, ptrs: tuple[int | None, ...], device: int) -> None:
    """The persistent TMA launch of plan ``p`` (``_linear_tma_kernel``, or
    ``_segmented_tma_kernel``); ``after``: the tensor parameter after the descriptors (the
    former's bias, the latter's peer output or None); ``ptrs``: the data pointers of x, w, out
    and ``after`` (None for None). The C launcher's arguments (the tensor maps of x, w and out
    encoded) are built once per (kernel, plan, addresses)."""
    launcher = _SEG_TMA if p.seg_tma else _TMA
    x_block, w_block, out_block = p.blocks

    def descriptors() -> tuple[Descriptor, ...]:
        return Descriptor(x, x_block), Descriptor(w, w_block), Descriptor(out, out_block)

    direct = launcher.direct(p.key, device)
    if direct is None:
        launcher(p.key, p.grid, *descriptors(), after, *p.tail, **p.options)
        return
    where = (launcher, p.key, p.tail[0], *ptrs)  # the key and M fix shapes, strides and blocks
    args = _TMA_ARGS.get(where)
    if args is None:
        if len(_TMA_ARGS) >= TMA_ARGS_KEPT:
            _TMA_ARGS.clear()
        args = _TMA_ARGS[where] = (*direct.tensor_maps(descriptors()), *ptrs[3:], *p.tail)
    direct(p.grid, args)


@dataclasses.dataclass(frozen=True)
class _SumPlan:
    """One launch of ``_sum_partials_kernel``: its launch key, grid, the arguments after the
    four tensors (partials, bias, out, peer output or None; the tail's last says whether it
    stores into the peer output too) and the launch options."""

    key: int
    grid: tuple[int, int, int]
    tail: tuple
    options: dict


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One product's launches, everything but the tensors: the launch key, grid, the arguments
    after the tensors and the launch options of the GEMM kernel (TMA or pointer), and for the
    split schedule the partial count and the sum kernel's launch (``sum`` None: the partials are
    tree-summed in torch). ``peer``: the GEMM kernel stores its output into the peer output too
    (where it stores the final values: not when it writes the split schedule's partials)."""

    tma: bool
    key: int
    grid: tuple[int, int, int]
    tail: tuple
    options: dict
    blocks: tuple[tuple[int, int], ...] = ()  # TMA: the x, w and out descriptors' blocks
    partials: int = 0
    sum: _SumPlan | None = None
    seg_tma: bool = False  # the launch is _segmented_tma_kernel's
    fused: bool = False  # _linear_kernel's programs each walk all their tile's segments
    peer: bool = False

    @property
    def schedule(self) -> str:
        """The kernel schedule: "tma" (one segment), "segmented tma", "split" (a partial per
        segment, then the sum), "fused tree" (one program per tile walks its segments) or
        "pointer" (one segment)."""
        if self.tma or self.seg_tma:
            return "segmented tma" if self.seg_tma else "tma"
        if self.partials or self.grid[1] > 1:
            return "split"
        return "fused tree" if self.fused else "pointer"


def plan_of(x: torch.Tensor, w: torch.Tensor, cfg: GemmConfig | None = None,
            segments: int | SegmentLayout | None = None) -> _Plan:
    """The plan ``run`` makes for x [M, K] @ w.T into a new [M, N] output of x's dtype, no bias
    (benchmarks and tests name the schedule and tile that ran)."""
    m, k = x.shape
    offsets = (x.data_ptr() & 15, w.data_ptr() & 15, x.data_ptr() & 15, 0)
    return _plan(m, w.shape[0], k, x.dtype, w.dtype, x.dtype, False, None, x.stride(0),
                 w.stride(0), w.shape[0], cfg, segments, programmatic(x), offsets,
                 x.is_contiguous() and w.is_contiguous())


@functools.lru_cache(maxsize=4096)
def _plan(m: int, n: int, k: int, x_dtype: torch.dtype, w_dtype: torch.dtype,
          out_dtype: torch.dtype, keep: bool, b_dtype: torch.dtype | None, stride_x: int,
          stride_w: int, stride_o: int, cfg: GemmConfig | None,
          segments: int | SegmentLayout | None, pdl: bool,
          offsets: tuple[int, int, int, int], contiguous: bool, peer: int | None = None
          ) -> _Plan:
    """The launches of ``run`` for these shapes, strides, dtypes (``b_dtype`` None: no bias),
    pointer offsets (the data pointers of x, w, bias and out mod 16) and contiguity; ``keep``:
    ``out`` is [S, M, N] and receives the partials; ``peer``: None, or the offset mod 16 of a
    peer output laid out as ``out`` that receives its values too. Every launch key holds what
    Triton specializes on, including the integer width of the unspecialized M * N (i64 from
    2**31)."""
    has_bias, wide = b_dtype is not None, m * n >= 2 ** 31
    has_peer, align = peer is not None, alignment(*offsets, 1 if peer is None else peer)
    segments = num_segments(k, n) if segments is None else segments
    layout = uniform_layout(k, segments) if isinstance(segments, int) else segments
    segs = layout.count
    plain_tma = segs == 1 and not keep and not has_peer and _tma_ok(
        x_dtype, w_dtype, out_dtype, k, n, align, contiguous)  # the one-segment TMA kernel runs it
    cfg = pick_config(m, n, k, x_dtype, plain_tma) if cfg is None else cfg
    if cfg.tma and plain_tma:
        return _tma_plan(m, n, k, x_dtype, w_dtype, out_dtype, b_dtype, cfg, pdl, align)
    if (cfg.tma and segs <= SEGMENTED_TMA_MAX and not keep and b_dtype is None
            and layout.even(k, cfg.block_k) and layout.count * layout.base == k
            and _tma_ok(x_dtype, w_dtype, out_dtype, k, n, align, contiguous, wide_out=True)):
        return _seg_tma_plan(m, n, k, x_dtype, w_dtype, out_dtype, layout, cfg, pdl,
                             None if peer is None else bool(align & 16))
    if cfg.tma and (segs > 1 or has_peer or out_dtype == torch.float32):
        cfg = SEGMENTED_TILE  # the pointer kernel's tile for what the TMA kernels did not take
    even = layout.even(k, cfg.block_k)
    fused = not keep and 1 < segs <= FUSED_MAX_SEGS and tree_kernel_sums(segs) and even and \
        FUSED_MIN_M < m <= SPLIT_MAX_M  # one program per tile walks every segment
    split = keep or (segs > 1 and not fused)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    rows_aligned = bool(align & 2) and (stride_w * w_dtype.itemsize) % 16 == 0
    prefetch = cfg.prefetch if pdl and not split and rows_aligned else 0  # bulk prefetch: 16 B
    fresh = split and not keep  # the partials go to a new [S, M, N] fp32 buffer
    t_dtype, t_stride = (torch.float32, n) if fresh else (out_dtype, stride_o)
    t_align = (align | 8) & 15 if fresh else align  # bit 4: the peer's (the GEMM's own stores)
    gemm_peer = has_peer and not fresh
    key = _LINEAR.intern((x_dtype, w_dtype, t_dtype, b_dtype, n, k, stride_x, stride_w,
                          t_stride, layout, split, fused, cfg, even, pdl, prefetch, t_align, wide,
                          gemm_peer))
    tail = (m, n, k, stride_x, stride_w, t_stride, m * n, layout.base, layout.extra, split,
            segs if fused else 1, has_bias and not split, cfg.block_m, cfg.block_n, cfg.block_k,
            cfg.group_m, even, "ieee" if x_dtype == torch.float32 else "tf32", pdl, prefetch,
            cfg.num_warps * 32, gemm_peer)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl)
    plan = _Plan(False, key, (tiles, segs if split else 1, 1), tail, options, fused=fused,
                 peer=gemm_peer)
    if not fresh:
        return plan
    summed = None
    if tree_kernel_sums(segs):  # fresh partials are aligned; align's bits 2-4: b, out, peer
        summed = _sum_plan(m * n, n, segs, out_dtype, b_dtype, pdl, 1 | (align >> 2) << 1,
                           has_peer)
    return dataclasses.replace(plan, partials=segs, sum=summed)


def tree_kernel_sums(segs: int) -> bool:
    """Whether ``_sum_partials_kernel`` adds ``segs`` partials (a power of two up to
    ``TREE_KERNEL_MAX``)."""
    return 0 < segs <= TREE_KERNEL_MAX and segs & (segs - 1) == 0


@functools.lru_cache(maxsize=4096)
def _sum_plan(mn: int, n: int, segs: int, out_dtype: torch.dtype, b_dtype: torch.dtype | None,
              pdl: bool, align: int, peer: bool = False) -> _SumPlan:
    """The tree sum of ``segs`` (``tree_kernel_sums``) contiguous fp32 [MN] partials into an
    [MN] ``out_dtype`` output whose rows have ``n`` elements (``b_dtype`` None: no bias), and
    into a peer output of out's layout too (``peer``); ``align``: the 16-byte alignment bits of
    the partials, the bias, out and the peer output (``alignment``)."""
    block = max(128, min(1024, 8192 // segs))  # the [segs, block] tile stays in registers
    key = _SUM_PARTIALS.intern((out_dtype, b_dtype, n, segs, pdl, align, mn >= 2 ** 31,
                                mn % 16 == 0, mn == 1, peer))  # MN is specialized
    return _SumPlan(key, (triton.cdiv(mn, block), 1, 1),
                    (mn, n, segs, b_dtype is not None, block, pdl, peer),
                    dict(num_warps=4, launch_pdl=pdl))


def _tma_plan(m: int, n: int, k: int, x_dtype: torch.dtype, w_dtype: torch.dtype,
              out_dtype: torch.dtype, b_dtype: torch.dtype | None, cfg: GemmConfig, pdl: bool,
              align: int) -> _Plan:
    has_bias = b_dtype is not None
    programs = _programs(m, n, cfg)
    key = _TMA.intern((x_dtype, w_dtype, out_dtype, b_dtype, n, k, cfg, programs, pdl,
                       bool(align & 4)))
    tail = (m, n, k, has_bias, cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, programs, pdl)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl)
    blocks = ((cfg.block_m, cfg.block_k), (cfg.block_n, cfg.block_k), (cfg.block_m, cfg.block_n))
    return _Plan(True, key, (programs, 1, 1), tail, options, blocks)


def _seg_tma_plan(m: int, n: int, k: int, x_dtype: torch.dtype, w_dtype: torch.dtype,
                  out_dtype: torch.dtype, layout: SegmentLayout, cfg: GemmConfig,
                  pdl: bool, peer: bool | None = None) -> _Plan:
    """``_segmented_tma_kernel``'s launch: ``layout`` even for cfg.block_k, no bias; ``peer``:
    None, or whether the peer output (stored too) is 16-byte aligned. A tile whose stages and
    output staging buffer overflow shared memory (an fp32 output is twice a bf16 one) takes half
    the BLOCK_K and up to twice the stages less one (at most 4); with a peer output (a second
    output tile of shared memory) it then drops stages, down to 2, before halving BLOCK_K
    again. A tile wider than 128 columns that overflows first stores its output in two halves
    (``subtile``). Every tile ``segmented_tma_config`` gives then fits (else ValueError)."""
    outputs = 1 + (peer is not None)
    if cfg.block_n > 128 and smem_bytes(cfg, x_dtype, out_dtype, outputs) > SMEM_BYTES:
        cfg = dataclasses.replace(cfg, subtile=True)
    while smem_bytes(cfg, x_dtype, out_dtype) > SMEM_BYTES and cfg.block_k > MIN_BLOCK_K:
        cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2,
                                  num_stages=min(2 * cfg.num_stages - 1, 4))
    while peer is not None and smem_bytes(cfg, x_dtype, out_dtype, 2) > SMEM_BYTES and (
            cfg.num_stages > 2 or cfg.block_k > MIN_BLOCK_K):
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1) if cfg.num_stages > 2 \
            else dataclasses.replace(cfg, block_k=cfg.block_k // 2)
    if smem_bytes(cfg, x_dtype, out_dtype, outputs) > SMEM_BYTES:
        raise ValueError(f"linear: {cfg} does not fit shared memory")
    programs = _programs(m, n, cfg)
    key = _SEG_TMA.intern((x_dtype, w_dtype, out_dtype, n, k, layout, cfg, programs, pdl, peer))
    tail = (m, n, k, layout.base // cfg.block_k, layout.count, cfg.block_m, cfg.block_n,
            cfg.block_k, cfg.group_m, programs, pdl, peer is not None, cfg.subtile)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl)
    blocks = ((cfg.block_m, cfg.block_k), (cfg.block_n, cfg.block_k),
              (cfg.block_m, cfg.block_n // (2 if cfg.subtile else 1)))
    return _Plan(False, key, (programs, 1, 1), tail, options, blocks, seg_tma=True,
                 peer=peer is not None)


def _programs(m: int, n: int, cfg: GemmConfig) -> int:
    """A persistent kernel's program count: one per SM, at most one per output tile."""
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return min(tiles, _num_sms(torch.cuda.current_device()) if torch.cuda.is_initialized()
               else 4)


_LINEAR = Launcher(K._linear_kernel)
_SUM_PARTIALS = Launcher(K._sum_partials_kernel)
_TMA = Launcher(K._linear_tma_kernel)
_SEG_TMA = Launcher(K._segmented_tma_kernel)
TMA_ARGS_KEPT = 512
_TMA_ARGS: dict[tuple, tuple] = {}  # (TMA key, M, x, w, out, bias addresses) -> C launcher args


def _tma_ok(x_dtype: torch.dtype, w_dtype: torch.dtype, out_dtype: torch.dtype, k: int, n: int,
            align: int, contiguous: bool, wide_out: bool = False) -> bool:
    """TMA needs 16-bit, contiguous, 16-byte aligned x, w and out (alignment bits 0, 1, 3) whose
    rows are whole multiples of 16 bytes; ``wide_out``: out may also be fp32."""
    sixteen = (torch.bfloat16, torch.float16)
    outs = (*sixteen, torch.float32) if wide_out else sixteen
    return (x_dtype in sixteen and w_dtype in sixteen and out_dtype in outs and contiguous
            and align & 0b1011 == 0b1011 and (k * x_dtype.itemsize) % 16 == 0
            and (k * w_dtype.itemsize) % 16 == 0 and (n * out_dtype.itemsize) % 16 == 0)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
