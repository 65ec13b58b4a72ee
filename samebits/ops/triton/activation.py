"""SiLU-and-multiply on CUDA in one kernel, with the bits of torch's ``F.silu(gate) * up``.

torch computes SiLU in fp32 ("opmath") as ``x / (1 + expf(-x))`` -- the accurate ``expf`` (libdevice
``__nv_expf``, denormals kept) and an IEEE-rounded division -- rounds it to the dtype, then takes
the product with ``up`` in fp32, rounded to the dtype. The kernel does the same operations:
``libdevice.exp`` (no FTZ), ``tl.div_rn``, the two roundings. ``FP_FUSION`` mirrors nvcc's default
(``--fmad=true``), under which torch's kernel was compiled: the only multiply-add it can contract is
the one inside ``expf`` and the ``1 +`` after it, as nvcc may; tests/gpu/test_fused_gpu.py checks
the bits against torch and records which setting matches.

``gate`` and ``up`` may be strided views (the two halves of the fused gate_up product's rows): no
copy is made. Invariance: elementwise; an element's bits depend on its two inputs alone.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from samebits.ops.triton.launcher import programmatic, wait_for_inputs

FP_FUSION = True
BLOCK = 1024
# The interpreter has no libdevice: numpy's exp there (tests compare against the same formula).
ACCURATE_EXP = os.environ.get("TRITON_INTERPRET", "0") != "1"
# libdevice's flush-to-zero switch (a Triton option since 3.2): torch keeps denormals
_NO_FTZ = {"enable_reflect_ftz": False}


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, N, stride_g, stride_u, stride_o,
                     BLOCK: tl.constexpr, ACCURATE: tl.constexpr, PDL: tl.constexpr):
    """out[m, n] = round(round(silu(gate[m, n])) * up[m, n]); program (m, j): columns of block j."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0)
    x = g.to(tl.float32)
    if ACCURATE:
        e = libdevice.exp(-x)
    else:
        e = tl.exp(-x)
    silu = tl.div_rn(x, 1.0 + e).to(g.dtype)
    out = (silu.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def supports(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Same shape and float dtype, unit stride along the last dim."""
    return (gate.shape == up.shape and gate.dtype == up.dtype and gate.dim() >= 1
            and gate.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and gate.stride(-1) == 1 and up.stride(-1) == 1)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., N] as [M, N] with unit column stride (a view whenever torch can make one)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def silu_mul(gate: torch.Tensor, up: torch.Tensor, fp_fusion: bool = FP_FUSION) -> torch.Tensor:
    """SiLU(gate) * up -> a new contiguous tensor of gate's shape; one launch."""
    g2, u2 = _rows(gate), _rows(up)
    m, n = g2.shape
    out = torch.empty((m, n), dtype=gate.dtype, device=gate.device)
    if m and n:
        pdl = programmatic(out)
        _silu_mul_kernel[(m, triton.cdiv(n, BLOCK))](
            g2, u2, out, n, g2.stride(0), u2.stride(0), out.stride(0), BLOCK=BLOCK,
            ACCURATE=ACCURATE_EXP, PDL=pdl, num_warps=4, enable_fp_fusion=fp_fusion,
            launch_pdl=pdl, **_NO_FTZ)
    return out.view(gate.shape)
