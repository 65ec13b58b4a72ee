"""The sampler on CUDA at Qwen3's vocabulary size: the fused Gumbel-max kernel draws the torch
path's token, and a row's token is the same alone or in a batch of 64."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from samebits.engine import sampler  # noqa: E402
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
