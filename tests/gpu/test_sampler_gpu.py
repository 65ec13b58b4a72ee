"""The sampler on CUDA at Qwen3's vocabulary size: the fused Gumbel-max kernel draws the torch
path's token; the rejection chain draws the sorted definition's token on near-uniform, peaked, tied
and masked rows, whatever its chunk and block sizes; its exp is torch's on every input it can see;
and a row's token is the same alone or in a batch of 64."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from samebits.engine import sampler  # noqa: E402
from samebits.ops.triton.rejection_chain import _LAUNCH, _exp  # noqa: E402
from samebits.sampling_params import SamplingParams  # noqa: E402

V = 151936
PARAMS = [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.0, top_k=50),
          SamplingParams(temperature=0.7, top_p=0.9, min_p=0.02),
          SamplingParams(temperature=1.3, top_k=20, top_p=0.8)]


def _logits(b: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = torch.logspace(-2, 1.5, b, device="cuda")[:, None]  # near-uniform to peaked
    x = torch.randn(b, V, device="cuda", generator=gen) * scale
    x[::7, :300] = x[::7].amax(-1, keepdim=True)  # 300-way ties at the top
    return x


def test_gpu_fused_gumbel_argmax_equals_the_torch_expression():
    x = _logits(64)
    keep = torch.rand(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)) < 0.5
    keys = torch.tensor([sampler.stream_key(r, 9) for r in range(64)], device="cuda")
    want = (x.masked_fill(~keep, float("-inf")) + sampler.gumbel_noise(keys, V)).argmax(-1)
    from samebits.ops.triton.gumbel import gumbel_argmax
    assert torch.equal(gumbel_argmax(x, keep, keys), want)


def test_gpu_sampled_row_is_the_same_alone_or_in_a_batch_of_64():

    x = _logits(64)
    params = [PARAMS[i % len(PARAMS)] for i in range(64)]
    batch = sampler.sample(x, params, list(range(64)), [1] * 64)
    alone = [sampler.sample(x[i:i + 1], [params[i]], [i], [1])[0] for i in range(64)]
    assert batch == alone


# ---- the rejection chain (ops/triton/rejection_chain.py) ---------------------------------------

CHAIN_PARAMS = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(top_k=1),
                SamplingParams(top_k=50), SamplingParams(temperature=1.5, top_k=1000),
                SamplingParams(top_k=V - 1), SamplingParams(top_p=1e-6), SamplingParams(top_p=0.5),
                SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(min_p=0.05),
                SamplingParams(temperature=2.0, min_p=0.9),
                SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02),
                SamplingParams(temperature=1.3, top_k=400, top_p=0.7)]


def _chain_logits(b: int, seed: int) -> torch.Tensor:
    """Near-uniform to peaked rows, 300-way top ties, coarse ties and masked rows."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = _logits(b)[torch.randperm(b, device="cuda", generator=gen)]
    x[1::5] = (x[1::5] * 3).round()
    mask = torch.rand(x.shape, device="cuda", generator=gen) < 0.6
    x[2::5] = x[2::5].masked_fill(mask[2::5], float("-inf"))
    return x


@pytest.mark.parametrize("b", [1, 64])
def test_gpu_chain_draws_the_sorted_definitions_token(b: int) -> None:
    for seed in range(3):
        x = _chain_logits(64, seed)[:b]
        params = [CHAIN_PARAMS[(i + seed) % len(CHAIN_PARAMS)] for i in range(b)]
        seeds, index = [97 * i + seed for i in range(b)], [seed] * b
        want = sampler.sample_sorted(x, params, seeds, index)
        assert sampler.sample_chained(x, params, seeds, index) == want
        assert sampler.sample(x, params, seeds, index) == want


def test_gpu_chain_chunk_and_block_change_no_token() -> None:
    x = _chain_logits(64, 5)
    params = [CHAIN_PARAMS[i % len(CHAIN_PARAMS)] for i in range(64)]
    want = sampler.sample_chained(x, params, list(range(64)), [2] * 64)
    for chunk, block in [(2048, 1024), (4096, 512), (16384, 2048)]:
        assert sampler.sample_chained(x, params, list(range(64)), [2] * 64, chunk=chunk,
                                      block=block) == want


@triton.jit
def _probe(x_ptr, t, y_ptr, z_ptr, n, BLOCK: tl.constexpr):
    """The chain kernels' exp (w) and temperature division, elementwise."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(y_ptr + i, _exp(x), mask=i < n)
    tl.store(z_ptr + i, tl.div_rn(x, t), mask=i < n)


def test_gpu_kernel_exp_is_torch_exp_on_every_nonpositive_fp32_and_div_rn_is_torch_div() -> None:
    # x - max is in [-inf, 0]: w and q = floor(w * 2**32) equal torch's on every such input
    t = torch.tensor(0.7, device="cuda")
    step = 1 << 28
    lo, hi = -(1 << 31), -(1 << 23)  # bit patterns of -0.0 .. -inf as int32
    for start in list(range(lo, hi + 1, step)) + [0]:  # and +0.0
        bits = torch.arange(start, min(start + step, hi + 1) if start else 1, device="cuda",
                            dtype=torch.int32)
        x = bits.view(torch.float32)
        y, z = torch.empty_like(x), torch.empty_like(x)
        _probe[(triton.cdiv(x.numel(), 4096),)](x, 0.7, y, z, x.numel(), BLOCK=4096,
                                                **_LAUNCH)
        assert torch.equal(y.view(torch.int32), torch.exp(x).view(torch.int32)), start
        q = torch.floor(y * 2.0 ** 32).to(torch.int64)
        assert torch.equal(q, torch.floor(torch.exp(x) * 2.0 ** 32).to(torch.int64))
        finite = torch.isfinite(x)
        assert torch.equal(z[finite].view(torch.int32), (x / t)[finite].view(torch.int32)), start
        del bits, x, y, z, q
