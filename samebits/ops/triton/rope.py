"""The attention prologue on CUDA in one kernel: per-head RMSNorm (Qwen3's q_norm / k_norm), RoPE
and the paged KV-cache write, read straight from the qkv projection's output.

``qkv_rope_store`` has the bits of the composition ``samebits.ops.rope.qkv_rope_store`` over this
backend's ``rms_norm``:

- the norm: ``rms_norm.py``'s own helpers (``inv_rms``, ``normalize``, ``weigh``) on a
  ``[ROWS, BLOCK]`` tile of head rows loaded exactly as its kernel loads a tile, with the
  ``(ROWS, BLOCK, num_warps)`` of ``rms_norm._shape(D)`` and its fp-fusion setting: the row sum's
  tree is the one ``rms_norm`` reduces a head row with (tests/gpu/test_fused_gpu.py checks it);
- RoPE (HF's rotate_half) as torch's elementwise ops round it in the model's dtype:
  ``round(round(x * cos) + round(rotate_half(x) * sin))``, each product and sum in fp32 rounded
  once; on the GPU through ``mul.rn`` / ``add.rn``, which no fma contraction can merge;
- K and V stored into their slots of the caches [num_blocks, block_size, Hkv, D]; q returned
  contiguous [T, Hq, D].

Invariance: a head row's outputs depend on its own qkv values, its token's cos/sin, the norm weight
and eps -- not on T, the row's position, or the slots (the slot only says where K/V go).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from samebits.ops.triton.launcher import programmatic, wait_for_inputs
from samebits.ops.triton.rms_norm import FP_FUSION, _shape, inv_rms, normalize, weigh

# The interpreter has no inline PTX; numpy's float32 ops there are single IEEE operations anyway.
ROUNDED_PTX = os.environ.get("TRITON_INTERPRET", "0") != "1"


@triton.jit
def _mul(a, b, RN: tl.constexpr):
    """``a * b`` in fp32, rounded once, never contracted into an fma."""
    if RN:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def _add(a, b, RN: tl.constexpr):
    """``a + b`` in fp32, rounded once, never contracted into an fma."""
    if RN:
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return a + b


@triton.jit
def _rotate(x, r, c, s, RN: tl.constexpr):
    """``round(round(x * c) + round(r * s))`` in x's dtype (r: x's rotate_half partner)."""
    f = tl.float32
    t1 = _mul(x.to(f), c.to(f), RN).to(x.dtype)
    t2 = _mul(r.to(f), s.to(f), RN).to(x.dtype)
    return _add(t1.to(f), t2.to(f), RN).to(x.dtype)


@triton.jit
def _head_rows(pid, T, HEADS: tl.constexpr, ROWS: tl.constexpr):
    """Rows ``pid*ROWS ...`` of the [T * HEADS] head rows: (valid, token, head)."""
    r = pid * ROWS + tl.arange(0, ROWS)
    valid = r < T * HEADS
    return valid, (r // HEADS).to(tl.int64), (r % HEADS).to(tl.int64)


@triton.jit
def _norm_rope_rows(qkv_ptr, cos_ptr, sin_ptr, w_ptr, dst_ptr, src, dst, tok, valid, D, HALF_D,
                    stride_cos, eps, HAS_NORM: tl.constexpr, BLOCK: tl.constexpr,
                    HALF: tl.constexpr, RN: tl.constexpr):
    """Normalize (HAS_NORM), rotate and store head rows: row i reads ``qkv_ptr + src[i]`` and
    writes ``dst_ptr + dst[i]``, D columns each."""
    c = tl.arange(0, HALF)
    hmask = valid[:, None] & (c < HALF_D)[None, :]
    lo, hi = src[:, None] + c[None, :], src[:, None] + HALF_D + c[None, :]
    x1 = tl.load(qkv_ptr + lo, mask=hmask, other=0.0)
    x2 = tl.load(qkv_ptr + hi, mask=hmask, other=0.0)
    if HAS_NORM:  # the row's scale from a full-row tile, as rms_norm's kernel reduces it
        cols = tl.arange(0, BLOCK)
        mask = valid[:, None] & (cols < D)[None, :]
        x = tl.load(qkv_ptr + src[:, None] + cols[None, :], mask=mask, other=0.0)
        inv = inv_rms(x, D, eps)
        w1 = tl.load(w_ptr + c, mask=c < HALF_D, other=0.0)
        w2 = tl.load(w_ptr + HALF_D + c, mask=c < HALF_D, other=0.0)
        x1 = weigh(normalize(x1, inv), w1).to(x1.dtype)
        x2 = weigh(normalize(x2, inv), w2).to(x2.dtype)
    trig = tok[:, None] * stride_cos + c[None, :]
    cos1 = tl.load(cos_ptr + trig, mask=hmask, other=0.0)
    cos2 = tl.load(cos_ptr + trig + HALF_D, mask=hmask, other=0.0)
    sin1 = tl.load(sin_ptr + trig, mask=hmask, other=0.0)
    sin2 = tl.load(sin_ptr + trig + HALF_D, mask=hmask, other=0.0)
    out = dst_ptr + dst[:, None] + c[None, :]
    tl.store(out, _rotate(x1, -x2, cos1, sin1, RN), mask=hmask)
    tl.store(out + HALF_D, _rotate(x2, x1, cos2, sin2, RN), mask=hmask)


@triton.jit
def _qkv_rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, k_cache_ptr,
                           v_cache_ptr, slot_ptr, T, D, HALF_D, stride_qkv, stride_cos, eps,
                           HQ: tl.constexpr, HKV: tl.constexpr, HAS_NORM: tl.constexpr,
                           ROWS: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr,
                           RN: tl.constexpr, PDL: tl.constexpr):
    """Programs [0, nq): q head rows; [nq, nq + nk): k head rows; the rest: v head rows."""
    wait_for_inputs(PDL)
    pid = tl.program_id(0)
    nq, nk = tl.cdiv(T * HQ, ROWS), tl.cdiv(T * HKV, ROWS)
    if pid < nq:
        valid, tok, head = _head_rows(pid, T, HQ, ROWS)
        _norm_rope_rows(qkv_ptr, cos_ptr, sin_ptr, qw_ptr, q_ptr, tok * stride_qkv + head * D,
                        (tok * HQ + head) * D, tok, valid, D, HALF_D, stride_cos, eps,
                        HAS_NORM, BLOCK, HALF, RN)
    else:
        is_k = pid < nq + nk
        valid, tok, head = _head_rows(tl.where(is_k, pid - nq, pid - nq - nk), T, HKV, ROWS)
        slot = tl.load(slot_ptr + tok, mask=valid, other=0).to(tl.int64)
        src = tok * stride_qkv + (HQ + head) * D
        dst = (slot * HKV + head) * D
        if is_k:
            _norm_rope_rows(qkv_ptr, cos_ptr, sin_ptr, kw_ptr, k_cache_ptr, src, dst, tok, valid,
                            D, HALF_D, stride_cos, eps, HAS_NORM, BLOCK, HALF, RN)
        else:
            cols = tl.arange(0, BLOCK)
            mask = valid[:, None] & (cols < D)[None, :]
            v = tl.load(qkv_ptr + src[:, None] + HKV * D + cols[None, :], mask=mask, other=0.0)
            tl.store(v_cache_ptr + dst[:, None] + cols[None, :], v, mask=mask)


def supports(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
             k_norm: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
             hq: int, hkv: int, d: int) -> bool:
    """Whether the kernel takes these operands (else the backend runs the composition);
    ``slot_mapping`` is any integer tensor of one slot per token, as for ``store_kv``."""
    dt = qkv.dtype
    tensors = [cos, sin, k_cache, v_cache] + [w for w in (q_norm, k_norm) if w is not None]
    return (dt in (torch.float32, torch.bfloat16, torch.float16) and d % 2 == 0
            and (q_norm is None) == (k_norm is None) and qkv.dim() == 2
            and qkv.shape[1] == (hq + 2 * hkv) * d and qkv.stride(1) == 1
            and all(t.dtype == dt for t in tensors) and cos.shape == sin.shape == (qkv.shape[0], d)
            and cos.stride(-1) == sin.stride(-1) == 1 and cos.stride(0) == sin.stride(0)
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.shape[-2:] == (hkv, d) and v_cache.shape == k_cache.shape
            and all(w.is_contiguous() for w in (q_norm, k_norm) if w is not None))


def qkv_rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   hq: int, hkv: int, d: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D] (``out``, contiguous, when given); K/V written to
    their slots (module docstring). One launch; no host value of the batch but T (CUDA-graph
    safe)."""
    t = qkv.shape[0]
    q = torch.empty(t, hq, d, dtype=qkv.dtype, device=qkv.device) if out is None else out
    if t == 0:
        return q
    rows, block, warps = _shape(d)
    grid = (triton.cdiv(t * hq, rows) + 2 * triton.cdiv(t * hkv, rows),)
    has_norm, pdl = q_norm is not None, programmatic(qkv)
    _qkv_rope_store_kernel[grid](
        qkv, cos, sin, q_norm if has_norm else qkv, k_norm if has_norm else qkv, q, k_cache,
        v_cache, slot_mapping, t, d, d // 2, qkv.stride(0), cos.stride(0), eps, HQ=hq, HKV=hkv,
        HAS_NORM=has_norm, ROWS=rows, BLOCK=block, HALF=triton.next_power_of_2(d // 2),
        RN=ROUNDED_PTX, PDL=pdl, num_warps=warps, enable_fp_fusion=FP_FUSION, launch_pdl=pdl)
    return q
