"""The sampler on CUDA: the radix keep set equals the full-sort definition on Qwen3's vocabulary
size, and a row's token is the same alone or in a batch of 64."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from samebits.engine import sampler  # noqa: E402
from samebits.engine.token_filter import keep_by_radix, keep_by_sort, weights  # noqa: E402
from samebits.ops import get_backend  # noqa: E402
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


@pytest.mark.parametrize("top_k,top_p", [(0, 0.95), (50, 1.0), (20, 0.8), (0, 0.5), (5000, 0.99)])
def test_gpu_radix_keep_set_equals_the_sort_definition(top_k, top_p):
    x = _logits(64)
    _, q = weights(x)
    k = torch.full((64,), top_k if top_k else V, device="cuda")
    p = torch.full((64,), top_p, device="cuda", dtype=torch.float64)
    assert torch.equal(keep_by_radix(x, q, k, p), keep_by_sort(x, q, k, p))


def test_gpu_sampled_row_is_the_same_alone_or_in_a_batch_of_64():
    ops = get_backend("cuda", True)
    x = _logits(64)
    params = [PARAMS[i % len(PARAMS)] for i in range(64)]
    batch, _ = sampler.sample(ops, x, params, list(range(64)), [1] * 64)
    alone = [sampler.sample(ops, x[i:i + 1], [params[i]], [i], [1])[0][0] for i in range(64)]
    assert batch == alone
