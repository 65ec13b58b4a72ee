"""Bits of the Triton rms_norm, add_rms_norm, softmax, log_softmax: row i is the same for any M.

Negative control: the stock torch ops on the same rows (recorded; PyTorch's row kernels often are
batch-invariant already, in which case the record says so).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from samebits.ops.standard import StandardBackend  # noqa: E402
from samebits.ops.triton import rms_norm as RN  # noqa: E402
from samebits.ops.triton import softmax as SM  # noqa: E402
from tests.gpu.findings import record  # noqa: E402

MS = [*range(1, 513), 1000, 2048, 4099]


def _rows_bad(fn, x: torch.Tensor, ms) -> list[int]:
    ref = torch.cat([fn(x[i:i + 1]) for i in range(min(512, x.shape[0]))])
    return [m for m in ms if not torch.equal(fn(x[:m])[:512], ref[:min(m, 512)])]


@pytest.mark.parametrize("h", [128, 4096, 5120])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_rows(h: int, dtype: torch.dtype) -> None:
    x = (torch.randn(max(MS), h, device="cuda") * 3).to(dtype)
    w = torch.rand(h, device="cuda").to(dtype) + 0.5
    assert _rows_bad(lambda t: RN.rms_norm(t, w, 1e-6), x, MS) == []
    ref = StandardBackend().rms_norm(x, w, 1e-6)
    out = RN.rms_norm(x, w, 1e-6)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    stock = _rows_bad(lambda t: StandardBackend().rms_norm(t, w, 1e-6), x, MS[::16])
    record("rms_norm_negative_control", h=h, dtype=str(dtype), stock_differs_at=len(stock),
           of=len(MS[::16]))


def test_add_rms_norm_rows() -> None:
    x = torch.randn(2048, 4096, device="cuda").bfloat16()
    r = torch.randn(2048, 4096, device="cuda").bfloat16()
    w = torch.rand(4096, device="cuda").bfloat16()
    out, summed = RN.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(summed, x + r)
    assert torch.equal(out, RN.rms_norm(x + r, w, 1e-5))
    for m in (1, 3, 64, 511):
        o, s = RN.add_rms_norm(x[:m], r[:m], w, 1e-5)
        assert torch.equal(o, out[:m]) and torch.equal(s, summed[:m])


@pytest.mark.parametrize("n", [1000, 32000, 151936])
@pytest.mark.parametrize("log", [False, True])
def test_softmax_rows(n: int, log: bool) -> None:
    x = torch.randn(4099 if n < 100000 else 1030, n, device="cuda") * 4
    fn = SM.log_softmax if log else SM.softmax
    ms = [m for m in MS if m <= x.shape[0]] if n < 100000 else [*range(1, 70), 255, 256, 1030]
    assert _rows_bad(fn, x, ms) == []
    ref = torch.log_softmax(x.double(), -1) if log else torch.softmax(x.double(), -1)
    torch.testing.assert_close(fn(x).double(), ref, rtol=1e-5, atol=1e-5)
    stock_fn = (lambda t: torch.log_softmax(t, -1)) if log else (lambda t: torch.softmax(t, -1))
    stock = _rows_bad(stock_fn, x, ms[::8])
    record("softmax_negative_control", n=n, log=log, stock_differs_at=len(stock),
           of=len(ms[::8]))


def test_bf16_logits_and_neg_inf() -> None:
    x = torch.randn(64, 5000, device="cuda").bfloat16()
    x[:, :100] = float("-inf")
    out = SM.log_softmax(x)
    assert out.dtype == torch.bfloat16 and torch.isinf(out[:, :100]).all()
    torch.testing.assert_close(out.float(), torch.log_softmax(x.float(), -1), rtol=2e-2,
                               atol=2e-2)
    assert torch.equal(SM.log_softmax(x[5:6]), out[5:6])
