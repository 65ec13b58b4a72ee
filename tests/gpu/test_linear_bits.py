"""Bits of the Triton linear: row i is the same for every M, position, tile config and schedule.

Negative control: the same comparisons through cuBLAS (F.linear), which does change with M.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from samebits.ops.triton import linear as L  # noqa: E402
from tests.gpu.findings import record  # noqa: E402

MAX_M = 512
BIG_MS = (513, 1000, 1024, 2048, 4097, 8192)
ZOO = [L.GemmConfig(16, 32, 256, 4, 4), L.GemmConfig(16, 64, 128, 4, 3),
       L.GemmConfig(32, 64, 128, 4, 4), L.GemmConfig(64, 64, 64, 4, 3),
       L.GemmConfig(64, 128, 64, 4, 4), L.GemmConfig(128, 128, 64, 8, 3),
       L.GemmConfig(128, 256, 64, 8, 3), L.GemmConfig(128, 64, 32, 4, 5),
       L.GemmConfig(64, 128, 64, 4, 4, tma=True), L.GemmConfig(128, 128, 64, 4, 4, tma=True),
       L.GemmConfig(128, 256, 64, 8, 3, tma=True), L.GemmConfig(128, 128, 64, 8, 4, tma=True)]


def _data(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
    return x, w


def _one_row_refs(fn, x: torch.Tensor, w: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([fn(x[i:i + 1], w) for i in range(rows)])


def _m_sweep(fn, x: torch.Tensor, w: torch.Tensor, ms) -> list[int]:
    """The M values at which some row of fn(x[:M]) differs from that row alone."""
    ref = _one_row_refs(fn, x, w, MAX_M)
    bad = []
    for m in ms:
        out = fn(x[:m], w)
        if not torch.equal(out[:MAX_M], ref[:min(m, MAX_M)]):
            bad.append(m)
    return bad


@pytest.mark.parametrize("k,n", [(4096, 4096), (4096, 6144), (12288, 4096), (1000, 200)])
def test_rows_equal_for_every_m_bf16(k: int, n: int) -> None:
    x, w = _data(max(BIG_MS), k, n, torch.bfloat16)
    ms = [*range(1, MAX_M + 1), *BIG_MS]
    assert _m_sweep(L.linear, x, w, ms) == []
    stock_bad = _m_sweep(F.linear, x, w, ms)
    record("linear_negative_control", k=k, n=n, dtype="bf16", cublas_differs_at=len(stock_bad),
           of=len(ms), first=stock_bad[:5])
    if (k, n) == (4096, 4096):  # docs/DESIGN.md section 2: cuBLAS changes row bits with M here
        assert stock_bad, "cuBLAS was expected to change row bits with M at (4096, 4096)"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rows_equal_other_dtypes(dtype: torch.dtype) -> None:
    x, w = _data(2048, 2048, 768, dtype)
    ms = [*range(1, 130), 255, 256, 257, 511, 512, 1024, 2048]
    assert _m_sweep(L.linear, x, w, ms) == []
    record("linear_negative_control", k=2048, n=768, dtype=str(dtype),
           cublas_differs_at=len(_m_sweep(F.linear, x, w, ms)), of=len(ms))


def test_row_position_does_not_matter() -> None:
    x, w = _data(4096, 4096, 4096, torch.bfloat16, seed=1)
    ref = L.linear(x, w)
    perm = torch.randperm(4096, device="cuda")
    assert torch.equal(L.linear(x[perm], w), ref[perm])
    for m in (1, 7, 64, 300):
        assert torch.equal(L.linear(x[perm[:m]], w), ref[perm[:m]])


@pytest.mark.parametrize("k,n", [(4096, 4096), (4096, 6144), (1000, 200)])
def test_every_tile_config_and_schedule_same_bits(k: int, n: int) -> None:
    """Hopper fact (docs/DESIGN.md section 2): tile shape / mma flavour never changes the bits."""
    x, w = _data(300, k, n, torch.bfloat16, seed=2)
    b = torch.randn(n, device="cuda").to(torch.bfloat16)
    segs = L.num_segments(k, n)
    ref = L.linear(x, w, b)
    for cfg in ZOO:
        out = torch.empty_like(ref)
        L.run(x, w, b, out, cfg, segs)
        assert torch.equal(out, ref), cfg


def test_segmented_equals_split_k_and_is_close() -> None:
    x, w = _data(96, 4096, 1024, torch.bfloat16, seed=3)
    exact = x.double() @ w.double().T
    for segs in (1, 2, 3, 4):
        outs = []
        for cfg in (ZOO[0], ZOO[5], ZOO[3]):
            out = torch.empty(96, 1024, device="cuda", dtype=torch.bfloat16)
            L.run(x, w, None, out, cfg, segs)
            outs.append(out)
        assert all(torch.equal(o, outs[0]) for o in outs), segs
        rel = (outs[0].double() - exact).norm() / exact.norm()
        assert rel < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_close_to_torch_with_bias(dtype: torch.dtype) -> None:
    x, w = _data(333, 1536, 2560, dtype, seed=4)
    b = torch.randn(2560, device="cuda").to(dtype)
    exact = x.double() @ w.double().T + b.double()
    rel = (L.linear(x, w, b).double() - exact).norm() / exact.norm()
    assert rel < (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(L.linear(x[:1], w, b), L.linear(x, w, b)[:1])


def test_leading_dims_and_empty() -> None:
    x, w = _data(24, 256, 128, torch.bfloat16, seed=5)
    out = L.linear(x.view(2, 3, 4, 256), w)
    assert out.shape == (2, 3, 4, 128) and torch.equal(out.view(24, 128), L.linear(x, w))
    assert L.linear(x[:0], w).shape == (0, 128)
