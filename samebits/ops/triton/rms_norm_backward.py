"""RMSNorm's backward on CUDA in one pass (the trainer's backward; no forward bits depend on it).

For ``y = w * (h * r).to(x.dtype)`` with ``h = x.float()``, ``r = rsqrt(mean(h*h) + eps)``:
``gx = r * (g*w - h * r^2 * mean(g*w*h))`` (fp32, cast to x's dtype) and
``gw = sum_rows g * (h*r).to(x.dtype)`` -- the closed form of ``autograd._RMSNorm``. Each program
walks a fixed run of ``[ROWS, BLOCK]`` tiles and writes one fp32 partial of ``gw``; the partials
are summed in program order by ``torch.sum``. Deterministic: the tiling depends on the shape
alone and there are no atomics.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from samebits.ops.triton.launcher import Launcher, alignment
from samebits.ops.triton.rms_norm import _shape


@triton.jit(do_not_specialize=["M", "tiles_per_prog"])  # one compile serves every row count
def _rms_norm_bwd_kernel(x_ptr, w_ptr, g_ptr, gx_ptr, gw_ptr, M, H, stride_x, stride_g,
                         stride_gx, eps, tiles_per_prog, NEED_GX: tl.constexpr,
                         NEED_GW: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    cmask = cols < H
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK], tl.float32)
    for t in range(tiles_per_prog):
        rows = (pid * tiles_per_prog + t) * ROWS + tl.arange(0, ROWS)
        mask = (rows < M)[:, None] & cmask[None, :]
        rows = rows.to(tl.int64)
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        h = x.to(tl.float32)
        g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(h * h, axis=1) / H + eps)[:, None]
        if NEED_GX:
            dn = g * w[None, :]
            c = (r * r) * (tl.sum(dn * h, axis=1) / H)[:, None]
            gx = r * (dn - h * c)
            tl.store(gx_ptr + rows[:, None] * stride_gx + cols[None, :],
                     gx.to(gx_ptr.dtype.element_ty), mask=mask)
        if NEED_GW:
            n = (h * r).to(x.dtype).to(tl.float32)
            acc += tl.sum(g * n, axis=0)
    if NEED_GW:
        tl.store(gw_ptr + pid * BLOCK + cols, acc, mask=cmask)


_BACKWARD = Launcher(_rms_norm_bwd_kernel)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def rms_norm_backward(x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor, eps: float,
                      need_gx: bool, need_gw: bool
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    g2 = grad.reshape(-1, h)
    g2 = g2 if g2.stride(-1) == 1 else g2.contiguous()
    m = x2.shape[0]
    rows, block, warps = _shape(h)
    tiles = triton.cdiv(m, rows)
    sms = _num_sms(x.device.index or 0) if x.is_cuda else 4
    per = triton.cdiv(tiles, 4 * sms) if tiles else 1
    progs = triton.cdiv(tiles, per) if tiles else 0
    gx = torch.empty_like(x2) if need_gx else None
    part = torch.empty(progs, block, dtype=torch.float32, device=x.device) if need_gw else None
    if progs:
        tensors = (x2, w, g2, gx if gx is not None else x2, part if part is not None else x2)
        ptrs = tuple(t.data_ptr() for t in tensors)
        tail = (m, h, x2.stride(0), g2.stride(0), gx.stride(0) if gx is not None else 0, eps, per,
                need_gx, need_gw, rows, block)
        key = (x2.dtype, w.dtype, g2.dtype, *tail[1:5], need_gx, need_gw, alignment(*ptrs))
        direct = _BACKWARD.direct(key, x2.get_device())
        if direct is not None:
            direct((progs, 1, 1), (*ptrs, *tail))
        else:
            _BACKWARD(key, (progs, 1, 1), *tensors, *tail, num_warps=warps)
    gw = None
    if need_gw:
        gw = (part[:, :h].sum(0) if progs else torch.zeros(h, device=x.device)).to(w.dtype)
    return (gx.view(x.shape) if gx is not None else None), gw
